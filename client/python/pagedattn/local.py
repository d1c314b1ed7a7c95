"""LocalChannel: Decode steps to a server on this host through a shared-memory ring pair
(OpenLocalChannel) instead of an RPC per step. The segment layout and its memory ordering are
documented in the server's server/local/ring_layout.h (layout version 1); the offsets below
are that header's.

    with pagedattn.SystemRegion(1 << 20, client) as region, pagedattn.LocalChannel(client) as ch:
        out = region.alloc(...)
        ch.decode(layer, ids, region.put(q), output=out)   # same arguments as Client.decode

Every tensor goes by reference (TensorRefs into registered regions); output is required, lse
optional. The server validates each descriptor like a Decode RPC and raises the same errors
here (PagedAttnError with the gRPC code).

Memory ordering. The counters are read and written as aligned 8-byte ctypes values: each access
is one mov on x86-64, whose TSO order gives loads acquire and stores release semantics, which
is what the ring protocol needs. The wake-up of a sleeping server always goes through
FUTEX_WAKE (the kernel orders it), and before sleeping this side does a locked exchange through
libatomic when it is there (else it wakes at least every 2 ms). Other architectures are
refused (FAILED_PRECONDITION): their loads and stores need barriers that Python cannot issue.

Not thread-safe: one thread at a time per channel.
"""

import ctypes
import itertools
import mmap
import os
import platform
import select
import struct
import time
from typing import Optional

import grpc

from . import _protocol
from .errors import PagedAttnError, from_code, invalid_argument
from .types import DecodeCall, DecodeResult, TensorRef
from .v1 import pagedattn_pb2 as pb

LAYOUT_VERSION = 1
_MAGIC = 0x4C4E484341504150
_MAX_SEQUENCES = 256
_NAME_BYTES = 128
_MESSAGE_BYTES = 192
_SUBMIT_SLOT = struct.Struct("<QifII")            # request_id, layer, sm_scale, flags, count
_REF = struct.Struct(f"<{_NAME_BYTES}sQQ")        # region, offset, byte_size
_SUBMIT_BYTES = _SUBMIT_SLOT.size + 8 * _MAX_SEQUENCES + 5 * _REF.size
_COMPLETE_SLOT = struct.Struct(f"<QiI{_MESSAGE_BYTES}s")
# SegmentHeader offsets (ring_layout.h static_asserts).
_STATE, _SUBMIT_TAIL, _SUBMIT_HEAD, _COMPLETE_TAIL, _COMPLETE_HEAD = 56, 64, 128, 192, 256
_SERVER_FUTEX, _SERVER_SLEEPING, _CALLER_FUTEX, _CALLER_SLEEPING = 320, 324, 384, 388
_HEADER = struct.Struct("<QIIIIIIQQQI")  # magic .. state

_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _libatomic():
    try:
        lib = ctypes.CDLL("libatomic.so.1")
        fn = lib.__atomic_exchange_4
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int]
        fn.restype = ctypes.c_uint32
        return fn
    except (OSError, AttributeError):
        return None


class LocalChannel:
    """LocalChannel(client, owned_regions=(), submission_capacity=0, completion_capacity=0,
    spin_us=50): opens a channel through `client` (a pagedattn.Client on a Unix socket or
    loopback target; it must stay open). owned_regions: registered region names the server
    unregisters when the channel closes (or this process dies). Use as a context manager, or
    call close()."""

    def __init__(self, client, owned_regions=(), submission_capacity: int = 0,
                 completion_capacity: int = 0, spin_us: float = 50.0):
        if platform.machine() not in ("x86_64", "AMD64"):
            raise PagedAttnError(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"LocalChannel needs x86-64 (this is {platform.machine()})")
        self._client = client
        self._spin = spin_us * 1e-6
        self._request_ids = itertools.count(1)
        self._stash = []
        self._closed = False
        self._mm = None
        request = pb.OpenLocalChannelRequest(pid=os.getpid(),
                                             submission_capacity=submission_capacity,
                                             completion_capacity=completion_capacity,
                                             owned_regions=list(owned_regions))
        response = client._call(client._stub.OpenLocalChannel, request)
        self.channel_id = response.channel_id
        self.shm_name = response.shm_name
        self._server_gone = False
        self._server_pidfd = None
        if response.server_pid and hasattr(os, "pidfd_open"):
            try:
                self._server_pidfd = os.pidfd_open(response.server_pid)
            except OSError:
                pass
        if response.layout_version != LAYOUT_VERSION:
            self.close()
            raise PagedAttnError(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"server layout version {response.layout_version}, "
                                 f"this client's {LAYOUT_VERSION}")
        path = "/dev/shm/" + self.shm_name.lstrip("/")
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, response.segment_bytes, mmap.MAP_SHARED,
                                 mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
            os.unlink(path)  # mapped on both sides: nothing stays in /dev/shm however either ends
        (magic, version, self._sc, self._cc, submit_bytes, complete_bytes, _, submit_offset,
         complete_offset, _, _) = _HEADER.unpack_from(self._mm, 0)
        if (magic != _MAGIC or version != LAYOUT_VERSION or submit_bytes != _SUBMIT_BYTES
                or complete_bytes != _COMPLETE_SLOT.size):
            self.close()
            raise PagedAttnError(grpc.StatusCode.FAILED_PRECONDITION,
                                 "the local channel segment's header does not match")
        self._submit_offset, self._complete_offset = submit_offset, complete_offset
        word = lambda t, off: t.from_buffer(self._mm, off)  # noqa: E731
        self._submit_tail = word(ctypes.c_uint64, _SUBMIT_TAIL)
        self._submit_head = word(ctypes.c_uint64, _SUBMIT_HEAD)
        self._complete_tail = word(ctypes.c_uint64, _COMPLETE_TAIL)
        self._complete_head = word(ctypes.c_uint64, _COMPLETE_HEAD)
        self._state = word(ctypes.c_uint32, _STATE)
        self._server_futex = word(ctypes.c_uint32, _SERVER_FUTEX)
        self._caller_futex = word(ctypes.c_uint32, _CALLER_FUTEX)
        self._caller_sleeping = word(ctypes.c_uint32, _CALLER_SLEEPING)
        self._tail = self._submit_tail.value
        self._head = self._complete_head.value
        self._in_flight = 0
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.syscall.restype = ctypes.c_long
        self._exchange = _libatomic()

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """CloseLocalChannel (owned regions unregistered) and unmap; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._server_pidfd is not None:
            os.close(self._server_pidfd)
            self._server_pidfd = None
        if self._server_gone:
            self._unmap()
            return
        try:
            self._client._call(self._client._stub.CloseLocalChannel,
                               pb.CloseLocalChannelRequest(channel_id=self.channel_id))
        finally:
            self._unmap()

    def _unmap(self):
        # The ctypes views export the mmap's buffer: drop them before closing it.
        for name in ("_submit_tail", "_submit_head", "_complete_tail", "_complete_head",
                     "_state", "_server_futex", "_caller_futex", "_caller_sleeping"):
            self.__dict__.pop(name, None)
        if self._mm is not None:
            self._mm.close()
            self._mm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    # -- decodes ----------------------------------------------------------------------------
    def decode(self, layer: int, sequence_ids, q, k=None, v=None, sm_scale: float = 0.0,
               timeout: Optional[float] = None, *, output: TensorRef,
               lse: Optional[TensorRef] = None) -> DecodeResult:
        """Client.decode through the channel: q (and k, v) TensorRefs, output required. Returns
        when the results are in their regions (DecodeResult with output/lse None); raises the
        server's error."""
        request_id = self.submit(layer, sequence_ids, q, k, v, sm_scale, output=output, lse=lse)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            result = self._next_from_ring(deadline)
            if result.request_id == request_id:
                return result.check()
            self._stash.append(result)

    def submit(self, layer: int, sequence_ids, q, k=None, v=None, sm_scale: float = 0.0, *,
               output: TensorRef, lse: Optional[TensorRef] = None,
               request_id: Optional[int] = None) -> int:
        """Puts one Decode on the submission ring and returns its request id (next() returns
        its result). RESOURCE_EXHAUSTED when the ring is full."""
        self._check_open()
        for name, x in (("q", q), ("k", k), ("v", v), ("output", output), ("lse", lse)):
            if x is not None and not isinstance(x, TensorRef):
                raise invalid_argument(f"{name}: a local channel takes TensorRefs only")
        if output is None:
            raise invalid_argument("output is required on a local channel")
        if len(sequence_ids) > _MAX_SEQUENCES:
            raise invalid_argument(f"{len(sequence_ids)} sequence ids exceed {_MAX_SEQUENCES}")
        if request_id is None:
            request_id = next(self._request_ids)
        call = DecodeCall(layer, sequence_ids, q, k, v, sm_scale, output=output, lse=lse)
        request = _protocol.decode_request(self._client.config, call, request_id)
        if self._tail - self._submit_head.value >= self._sc:
            raise PagedAttnError(grpc.StatusCode.RESOURCE_EXHAUSTED, "the submission ring is full")
        at = self._submit_offset + (self._tail % self._sc) * _SUBMIT_BYTES
        _SUBMIT_SLOT.pack_into(self._mm, at, request.request_id, request.layer, request.sm_scale,
                               0, len(request.sequence_ids))
        ids = list(request.sequence_ids)
        struct.pack_into(f"<{len(ids)}Q", self._mm, at + _SUBMIT_SLOT.size, *ids)
        refs_at = at + _SUBMIT_SLOT.size + 8 * _MAX_SEQUENCES
        for i, field in enumerate(("q_ref", "k_ref", "v_ref", "output_ref", "lse_ref")):
            ref = getattr(request, field) if request.HasField(field) else None
            name = ref.region.encode() if ref is not None else b""
            if len(name) > _NAME_BYTES:
                raise invalid_argument(f"{field}: region name over {_NAME_BYTES} bytes")
            _REF.pack_into(self._mm, refs_at + i * _REF.size, name,
                           ref.offset if ref else 0, ref.byte_size if ref else 0)
        self._tail += 1
        self._submit_tail.value = self._tail  # one aligned store: release on x86-64
        self._wake_server()
        self._in_flight += 1
        return request_id

    def next(self, timeout: Optional[float] = None) -> DecodeResult:
        """The next completion (a DecodeResult with `error` set when that Decode failed);
        DEADLINE_EXCEEDED after `timeout` seconds, UNAVAILABLE once the channel closed."""
        if self._stash:
            return self._stash.pop(0)
        return self._next_from_ring(None if timeout is None else time.monotonic() + timeout)

    # -- internals --------------------------------------------------------------------------
    def _wake_server(self):
        """Bumps the server's futex word and wakes it: always a FUTEX_WAKE (no sleeping-flag
        shortcut, which would need a store-load fence between the counter and the flag)."""
        self._server_futex.value = (self._server_futex.value + 1) & 0xFFFFFFFF
        self._libc.syscall(ctypes.c_long(_SYS_FUTEX), ctypes.byref(self._server_futex),
                           ctypes.c_long(_FUTEX_WAKE), ctypes.c_long(1), None, None,
                           ctypes.c_long(0))

    def _check_server(self):
        """Once the server process has exited: UNAVAILABLE, and its segment unlinked."""
        if self._server_pidfd is not None and not self._server_gone:
            p = select.poll()
            p.register(self._server_pidfd, select.POLLIN)
            if p.poll(0):
                self._server_gone = True
                try:
                    os.unlink("/dev/shm/" + self.shm_name.lstrip("/"))
                except OSError:
                    pass
        if self._server_gone:
            raise PagedAttnError(grpc.StatusCode.UNAVAILABLE, "the server exited")

    def _check_open(self):
        if self._closed:
            raise PagedAttnError(grpc.StatusCode.UNAVAILABLE, "the local channel is closed")
        state = self._state.value
        if state == 2:
            raise PagedAttnError(grpc.StatusCode.DATA_LOSS,
                                 "the server closed the local channel: its rings were corrupted")
        if state != 0:
            raise PagedAttnError(grpc.StatusCode.UNAVAILABLE, "the local channel is closed")

    def _try_next(self):
        available = self._complete_tail.value - self._head  # one aligned load: acquire
        if available == 0:
            return None
        if available > self._cc:
            raise PagedAttnError(grpc.StatusCode.DATA_LOSS, "completion ring tail is corrupted")
        at = self._complete_offset + (self._head % self._cc) * _COMPLETE_SLOT.size
        request_id, code, n, message = _COMPLETE_SLOT.unpack_from(self._mm, at)
        self._head += 1
        self._complete_head.value = self._head
        self._in_flight -= 1
        self._wake_server()  # a server stalled on a full completion ring resumes on it
        if code != 0:
            text = message[:min(n, _MESSAGE_BYTES)].decode("utf-8", "replace")
            return DecodeResult(request_id=request_id, error=from_code(code, text))
        return DecodeResult(request_id=request_id)

    def _next_from_ring(self, deadline):
        start = time.monotonic()
        while True:
            result = self._try_next()
            if result is not None:
                return result
            self._check_open()
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise PagedAttnError(grpc.StatusCode.DEADLINE_EXCEEDED, "no completion yet")
            if now - start < self._spin:
                continue
            # Sleep (ring_layout.h): flag, take the futex value, look again, wait.
            if self._exchange is not None:
                self._exchange(ctypes.addressof(self._caller_sleeping), 1, 5)  # seq_cst xchg
            else:
                self._caller_sleeping.value = 1
            seen = self._caller_futex.value
            result = self._try_next()
            if result is None:
                wait = 0.002 if self._exchange is None else 0.05
                if deadline is not None:
                    wait = max(0.0, min(wait, deadline - now))
                ts = _Timespec(int(wait), int((wait % 1) * 1e9))
                self._libc.syscall(ctypes.c_long(_SYS_FUTEX), ctypes.byref(self._caller_futex),
                                   ctypes.c_long(_FUTEX_WAIT), ctypes.c_long(seen),
                                   ctypes.byref(ts), None, ctypes.c_long(0))
            self._caller_sleeping.value = 0
            self._check_server()
            if result is not None:
                return result
