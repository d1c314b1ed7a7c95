"""Memory regions for tensors by reference: memory of this process that the server maps, so
that a Decode or AppendKV names {region, offset, byte_size} (a TensorRef) instead of carrying
the bytes, and a Decode can write its output and lse there.

  SystemRegion  a POSIX shared-memory object this process creates (unique name, mode 0600, so
                the server must run as the same user), mapped here; numpy views at 16-byte
                aligned offsets. For a server on the same host, any backend.
  CudaRegion    a torch CUDA tensor's allocation, shared by CUDA IPC handle. For a server with
                the CUDA backend on the same host; the region holds a reference to the tensor
                (its memory must stay allocated while the server maps it).

Both register with a Client on construction (or later with register / register_async) and
unregister on close() / aclose() or at the end of a `with` block. Do not write an input or
read an output while a call that uses it is in flight: the memory is shared with the server.
"""

import ctypes
import itertools
import mmap
import os
import secrets
import sys
from typing import Optional

import grpc
import numpy as np

from . import bf16, tensors
from .errors import PagedAttnError, invalid_argument
from .types import TensorRef

ALIGNMENT = 16  # TensorRef offsets (and system region offsets) are multiples of this
_SHM_DIR = "/dev/shm"  # where Linux's shm_open keeps its objects
_serial = itertools.count(1)


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


class _Registration:
    """The part both region kinds share: the name it is registered under and the client that
    registered it, so that close() can unregister."""

    def __init__(self):
        self.name: Optional[str] = None
        self._client = None

    def _registered(self, client, name: str):
        self._client, self.name = client, name
        return self

    def _forget(self):
        client, name = self._client, self.name
        self._client = self.name = None
        return client, name

    # `with` closes (close()); `async with` closes for an AsyncClient (aclose()).
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()

    def _require_registered(self) -> str:
        if self.name is None:
            raise PagedAttnError(grpc.StatusCode.FAILED_PRECONDITION,
                                 "the region is not registered with a client")
        return self.name


class SystemRegion(_Registration):
    """SystemRegion(byte_size, client=None, name=None): a new shared-memory object of byte_size
    bytes (zero-filled), registered with `client` as `name` (default: its key without "/")
    when a client is given.

        with pagedattn.SystemRegion(1 << 20, client) as region:
            q = region.put(q_array)                # bf16 bits written at the next free offset
            out = region.alloc(out_bytes)          # space for a result
            client.decode(layer, ids, q, output=out)
            region.bf16(out, cfg.q_shape(len(ids)))  # float32 values of the output

    Not thread-safe (alloc, close); the views may be used from any thread."""

    def __init__(self, byte_size: int, client=None, name: Optional[str] = None,
                 prefix: str = "pa-py"):
        super().__init__()
        if int(byte_size) <= 0:
            raise invalid_argument(f"byte_size must be > 0, got {byte_size}")
        if not prefix or "/" in prefix or len(prefix) > 64:
            raise invalid_argument(f"bad prefix {prefix!r}")
        self.size = int(byte_size)
        base = f"{prefix}-{os.getpid()}-{next(_serial)}-{secrets.token_hex(4)}"
        self.key = "/" + base
        self._path = os.path.join(_SHM_DIR, base)
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.size)
            self._map = mmap.mmap(fd, self.size, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(self._path)
            raise
        os.close(fd)
        self._linked = True
        self._next = 0
        if client is not None:
            try:
                self.register(client, name)
            except BaseException:
                self._release()
                raise

    # -- registration ------------------------------------------------------------------------
    def register(self, client, name: Optional[str] = None) -> "SystemRegion":
        """Registers the whole object with a Client as `name` (default: the key without "/")."""
        name = name or self.key[1:]
        client.register_system_memory(name, self.key, 0, self.size)
        return self._registered(client, name)

    async def register_async(self, client, name: Optional[str] = None) -> "SystemRegion":
        """The same with an AsyncClient."""
        name = name or self.key[1:]
        await client.register_system_memory(name, self.key, 0, self.size)
        return self._registered(client, name)

    # -- places and views --------------------------------------------------------------------
    def ref(self, offset: int, byte_size: int) -> TensorRef:
        """The TensorRef of [offset, offset + byte_size): offset a multiple of 16, inside."""
        offset, byte_size = int(offset), int(byte_size)
        if offset % ALIGNMENT:
            raise invalid_argument(f"offset {offset} is not a multiple of {ALIGNMENT}")
        if offset < 0 or byte_size <= 0 or offset + byte_size > self.size:
            raise invalid_argument(f"[{offset}, {offset + byte_size}) is not inside the region "
                                   f"of {self.size} bytes")
        return TensorRef(self._require_registered(), offset, byte_size)

    def alloc(self, byte_size: int) -> TensorRef:
        """The next free byte_size bytes at a 16-byte aligned offset (a bump allocator;
        reset() starts again at 0). RESOURCE_EXHAUSTED when the region is full."""
        offset = _align(self._next)
        if offset + int(byte_size) > self.size:
            raise PagedAttnError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"{byte_size} more bytes do not fit in the region of "
                                 f"{self.size} bytes ({offset} used)")
        ref = self.ref(offset, byte_size)
        self._next = offset + int(byte_size)
        return ref

    def reset(self) -> None:
        self._next = 0

    def array(self, ref, dtype, shape) -> np.ndarray:
        """A numpy view (no copy) of `shape` and `dtype` at a TensorRef or an offset."""
        offset = ref.offset if isinstance(ref, TensorRef) else int(ref)
        count = int(np.prod(shape))
        view = np.frombuffer(self._map, dtype=dtype, count=count, offset=offset)
        return view.reshape(shape)

    def put(self, x, ref: Optional[TensorRef] = None, dtype: str = "bf16") -> TensorRef:
        """Writes x (a numpy array or torch tensor, converted to `dtype`, the server's
        ModelConfig.dtype, like an inline tensor) at `ref` (default: alloc of its size) and
        returns the TensorRef."""
        shape = tuple(getattr(x, "shape", ()))
        bits = tensors.as_bits(x, shape, "x", dtype)
        if ref is None:
            ref = self.alloc(bits.nbytes)
        elif ref.byte_size != bits.nbytes:
            raise invalid_argument(f"x holds {bits.nbytes} bytes of {dtype}, the ref "
                                   f"{ref.byte_size}")
        self.array(ref, np.uint16, shape)[...] = bits
        return ref

    def bf16(self, ref, shape) -> np.ndarray:
        """The bf16 tensor at `ref` as float32 values (a copy), e.g. a decode output."""
        return bf16.from_bits(self.array(ref, np.uint16, shape))

    def values(self, ref, shape, dtype: str = "bf16") -> np.ndarray:
        """The bf16 or fp16 tensor at `ref` as float32 values (a copy)."""
        return tensors.from_bits(self.array(ref, np.uint16, shape), dtype)

    def float32(self, ref, shape) -> np.ndarray:
        """The float32 tensor at `ref` (a copy), e.g. a decode lse."""
        return self.array(ref, np.float32, shape).copy()

    # -- the end -----------------------------------------------------------------------------
    def unlink(self) -> None:
        """Removes the object's name now; the mappings (here and the server's) stay."""
        if self._linked:
            self._linked = False
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass

    def _release(self) -> None:
        self.unlink()
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # numpy views still use it: unmapped when the last of them goes
            self._map = None

    def close(self) -> None:
        """Unregisters (waiting for the server's work that uses it), unmaps and unlinks.
        Idempotent; an unregister error is raised after the local cleanup."""
        client, name = self._forget()
        try:
            if client is not None:
                client.unregister_memory(name)
        finally:
            self._release()

    async def aclose(self) -> None:
        """close() for a region registered with an AsyncClient."""
        client, name = self._forget()
        try:
            if client is not None:
                await client.unregister_memory(name)
        finally:
            self._release()


class _Driver:
    """The two CUDA driver calls a CudaRegion needs, through libcuda (loaded on first use)."""
    _lib = None

    @classmethod
    def lib(cls):
        if cls._lib is None:
            try:
                cls._lib = ctypes.CDLL("libcuda.so.1")
            except OSError as e:
                raise PagedAttnError(grpc.StatusCode.FAILED_PRECONDITION,
                                     f"the CUDA driver library cannot be loaded: {e}") from None
        return cls._lib

    @classmethod
    def check(cls, rc: int, what: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            cls.lib().cuGetErrorName(rc, ctypes.byref(name))
            raise PagedAttnError(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"{what} failed: {(name.value or b'?').decode()} ({rc})")

    @classmethod
    def allocation(cls, pointer: int):
        """(base, size) of the cudaMalloc allocation holding `pointer`."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        cls.check(cls.lib().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                                    ctypes.c_uint64(pointer)),
                  "cuMemGetAddressRange")
        return base.value, size.value

    @classmethod
    def ipc_handle(cls, base: int) -> bytes:
        """The 64-byte cudaIpcMemHandle_t of the allocation starting at `base`."""
        handle = (ctypes.c_char * 64)()
        cls.check(cls.lib().cuIpcGetMemHandle(handle, ctypes.c_uint64(base)),
                  "cuIpcGetMemHandle")
        return bytes(handle)


class CudaRegion(_Registration):
    """CudaRegion(tensor, client=None, name=None): the CUDA allocation that holds a torch CUDA
    tensor's storage, shared by IPC handle and registered with `client` as `name` (default
    "cuda-<pid>-<n>") when a client is given. torch's caching allocator hands out pieces of
    larger cudaMalloc allocations and an IPC handle always names a whole allocation, so the
    region starts at the allocation's base, before the storage: ref() accounts for that.

        buf = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        with pagedattn.CudaRegion(buf, client) as region:
            q = region.ref(q_tensor)       # a tensor whose memory lies in buf
            client.decode(layer, ids, q, output=region.ref(out_tensor))

    The region keeps `tensor` (so its storage) alive until close(). Allocations from
    expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) have no legacy IPC
    handle: FAILED_PRECONDITION. Needs torch and the CUDA driver library."""

    def __init__(self, tensor, client=None, name: Optional[str] = None):
        super().__init__()
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(tensor, torch.Tensor) or not tensor.is_cuda:
            raise invalid_argument("CudaRegion takes a torch CUDA tensor")
        storage = tensor.untyped_storage()
        self.device_id = tensor.device.index
        with torch.cuda.device(self.device_id):
            torch.cuda.synchronize()  # the work that filled it is done; the context is current
            self._base, allocation_size = _Driver.allocation(storage.data_ptr())
            self.raw_handle = _Driver.ipc_handle(self._base)
        # The region: from the allocation's base to the end of this storage.
        self.byte_size = storage.data_ptr() + storage.nbytes() - self._base
        if not 0 < self.byte_size <= allocation_size:
            raise PagedAttnError(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"the storage ends {self.byte_size} bytes into an allocation "
                                 f"of {allocation_size}")
        self._tensor = tensor
        if client is not None:
            self.register(client, name)

    def register(self, client, name: Optional[str] = None) -> "CudaRegion":
        name = name or f"cuda-{os.getpid()}-{next(_serial)}"
        client.register_cuda_memory(name, self.raw_handle, self.device_id, self.byte_size)
        return self._registered(client, name)

    async def register_async(self, client, name: Optional[str] = None) -> "CudaRegion":
        name = name or f"cuda-{os.getpid()}-{next(_serial)}"
        await client.register_cuda_memory(name, self.raw_handle, self.device_id, self.byte_size)
        return self._registered(client, name)

    def offset_of(self, tensor) -> int:
        """Where `tensor` (a tensor in this region's storage) starts in the region."""
        return tensor.data_ptr() - self._base

    def ref(self, tensor) -> TensorRef:
        """The TensorRef of a contiguous tensor whose memory lies in this region (the tensor
        given to the constructor or a view of it). bf16 inputs and outputs are bfloat16
        tensors; an lse is float32."""
        if not tensor.is_contiguous():
            raise invalid_argument("a TensorRef names contiguous memory: the tensor is not")
        offset = self.offset_of(tensor)
        byte_size = tensor.numel() * tensor.element_size()
        if offset < 0 or offset + byte_size > self.byte_size:
            raise invalid_argument("the tensor does not lie in this region")
        if offset % ALIGNMENT:
            raise invalid_argument(f"the tensor starts at offset {offset} of the region, not a "
                                   f"multiple of {ALIGNMENT}")
        return TensorRef(self._require_registered(), offset, byte_size)

    def close(self) -> None:
        """Unregisters (waiting for the server's work that uses it), then drops the tensor.
        If unregistering fails (other than NOT_FOUND) the tensor is kept, since the server
        may still map it, and the error is raised."""
        client, name = self._forget()
        if client is not None:
            try:
                client.unregister_memory(name)
            except PagedAttnError as e:
                if e.code != grpc.StatusCode.NOT_FOUND:
                    raise
        self._tensor = None

    async def aclose(self) -> None:
        client, name = self._forget()
        if client is not None:
            try:
                await client.unregister_memory(name)
            except PagedAttnError as e:
                if e.code != grpc.StatusCode.NOT_FOUND:
                    raise
        self._tensor = None
