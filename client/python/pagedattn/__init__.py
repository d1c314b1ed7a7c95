"""pagedattn: the Python client of the pagedattn service (pagedattn.v1.PagedAttention), a paged
KV cache and decode attention served over gRPC.

    import numpy as np, pagedattn
    with pagedattn.Client("127.0.0.1:50051") as client:
        cfg = client.config                       # every shape comes from GetModelConfig
        client.create(7)
        ...

Client (sync) and AsyncClient (asyncio) take numpy arrays (float -> bf16 round to nearest
even, or uint16 bf16 bit patterns) and torch tensors when torch is imported; outputs are numpy
float32. Every failure raises PagedAttnError carrying the gRPC status code.

Tensors by reference: SystemRegion (POSIX shared memory) and CudaRegion (a torch CUDA
tensor's allocation, by IPC handle) register memory with the server; their TensorRefs go where
an array would (q, k, v) and as a decode's output / lse.

LocalChannel: decodes by reference to a server on this host through shared-memory rings
instead of an RPC each (same arguments as Client.decode; x86-64 only).
"""

from . import bf16, tensors
from .aio import AsyncClient, AsyncDecodeStream
from .client import Client
from .errors import PagedAttnError
from .local import LocalChannel
from .options import ClientOptions
from .regions import CudaRegion, SystemRegion
from .types import DecodeCall, DecodeResult, MemoryRegion, ModelConfig, Stats, TensorRef

__version__ = "0.1.0"

__all__ = [
    "AsyncClient", "AsyncDecodeStream", "Client", "ClientOptions", "CudaRegion", "DecodeCall",
    "DecodeResult", "LocalChannel", "MemoryRegion", "ModelConfig", "PagedAttnError", "Stats", "SystemRegion",
    "TensorRef", "bf16", "tensors",
]
