"""Plain values the clients return and take: the server's model config (every tensor shape comes
from it), its stats, a decode call and its result."""

import dataclasses
from typing import Optional, Sequence

import numpy as np

from .errors import PagedAttnError


def _from_message(cls, message):
    return cls(**{f.name: getattr(message, f.name) for f in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """GetModelConfig: the shapes and limits of this server."""
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_layers: int
    num_pages: int
    max_batch_size: int
    backend: str
    max_message_bytes: int
    # q, k, v and output on the wire: "bf16" or "fp16"; the pages: that, or "fp8_e4m3".
    dtype: str = "bf16"
    kv_cache_dtype: str = "bf16"

    @classmethod
    def from_message(cls, message) -> "ModelConfig":
        config = _from_message(cls, message)
        # A server from before these fields were added sends neither: it is bf16 throughout.
        if not config.dtype:
            config = dataclasses.replace(config, dtype="bf16", kv_cache_dtype="bf16")
        return config

    def q_shape(self, batch: int):
        """Decode q and output: [B, num_qo_heads, head_dim]."""
        return (batch, self.num_qo_heads, self.head_dim)

    def kv_shape(self, tokens: int):
        """AppendKV k/v ([tokens, ...]) and Decode k/v ([B, ...]): [n, num_kv_heads, head_dim]."""
        return (tokens, self.num_kv_heads, self.head_dim)

    def lse_shape(self, batch: int):
        return (batch, self.num_qo_heads)


@dataclasses.dataclass(frozen=True)
class Stats:
    """GetStats: pool and engine counters."""
    pages_total: int
    pages_free: int
    sequences: int
    tokens: int
    queue_depth: int
    batches: int
    decoded_sequences: int
    healthy: bool
    sequences_offloaded: int = 0  # the host tier (all 0 without one)
    host_pages_total: int = 0
    host_pages_free: int = 0

    @classmethod
    def from_message(cls, message) -> "Stats":
        return _from_message(cls, message)


@dataclasses.dataclass
class DecodeCall:
    """One Decode for a stream (Client.decode_stream, AsyncDecodeStream.decode): q is
    [B, num_qo_heads, head_dim]; k and v, both or neither, [B, num_kv_heads, head_dim] (the new
    token of each sequence: a decode step); without them the call only attends. q, k, v may each
    be a TensorRef instead of an array. output / lse: TensorRefs where the server writes the
    results (the result then carries None for them). sm_scale 0 means 1/sqrt(head_dim).
    request_id None: the stream numbers its requests."""
    layer: int
    sequence_ids: Sequence[int]
    q: object
    k: object = None
    v: object = None
    sm_scale: float = 0.0
    request_id: Optional[int] = None
    output: Optional["TensorRef"] = None
    lse: Optional["TensorRef"] = None


@dataclasses.dataclass
class DecodeResult:
    """A Decode's answer: output float32 [B, num_qo_heads, head_dim] (bf16 values, exact in
    float32), lse float32 [B, num_qo_heads] (log2 of the softmax denominator; -inf for a
    sequence without tokens). Either is None when the call gave a TensorRef for it (the server
    wrote it there). In a stream, a request that failed has `error` set and no tensors (the
    stream goes on); check() raises it."""
    request_id: int
    output: Optional[np.ndarray] = None
    lse: Optional[np.ndarray] = None
    error: Optional[PagedAttnError] = None

    def check(self) -> "DecodeResult":
        if self.error is not None:
            raise self.error
        return self


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """A tensor in a registered memory region (tensors by reference): bytes
    [offset, offset + byte_size) of the region named `region`. Pass one wherever a decode or
    append takes an array (q, k, v), or as a decode's `output` / `lse` to have the server write
    the result there. The server checks it (see pagedattn.proto, "Tensors by reference"):
    offset a multiple of 16, byte_size the tensor's inline size, the range inside the region;
    SystemRegion.ref / CudaRegion.ref build checked ones."""
    region: str
    offset: int
    byte_size: int

    def to_message(self):
        from .v1 import pagedattn_pb2 as pb  # pylint: disable=import-outside-toplevel
        return pb.TensorRef(region=self.region, offset=int(self.offset),
                            byte_size=int(self.byte_size))


@dataclasses.dataclass(frozen=True)
class MemoryRegion:
    """ListMemory: one registered region. kind "system" or "cuda"; device_id -1 for system."""
    name: str
    kind: str
    byte_size: int
    device_id: int

    @classmethod
    def from_message(cls, message) -> "MemoryRegion":
        return _from_message(cls, message)
