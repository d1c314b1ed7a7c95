"""AsyncClient: the asyncio client (grpc.aio), for pipelining micro-batches and layers.

Concurrent awaits on one AsyncClient run concurrently on one channel: decodes of different
micro-batches overlap on the server (and batch together there). Steps of one sequence must
reach the server layer by layer in order; across concurrent unary calls the order is not
guaranteed, so send a sequence's layers either one after another (await each) or on one
AsyncDecodeStream, which applies its requests in the order they were sent.

Create it inside a running event loop and close it there (`async with AsyncClient(...)`).
Every failure raises PagedAttnError with the call's gRPC status code.
"""

import asyncio
import collections
import itertools
from typing import List, Optional

import grpc
import grpc.aio

from . import _protocol
from .errors import PagedAttnError, from_rpc_error
from .options import ClientOptions, make_options
from .types import DecodeCall, DecodeResult, MemoryRegion, ModelConfig, Stats, TensorRef
from .v1 import pagedattn_pb2 as pb
from .v1 import pagedattn_pb2_grpc as pb_grpc


class AsyncClient:
    """AsyncClient("host:port", **ClientOptions fields); the same calls as Client, awaited."""

    def __init__(self, target: Optional[str] = None, *, options: Optional[ClientOptions] = None,
                 **fields):
        self.options = make_options(target, options, fields)
        credentials = self.options.credentials()
        args = self.options.channel_arguments()
        self._channel = (grpc.aio.secure_channel(self.options.target, credentials, options=args)
                         if credentials else
                         grpc.aio.insecure_channel(self.options.target, options=args))
        self._stub = pb_grpc.PagedAttentionStub(self._channel)
        self._health = self._channel.unary_unary(_protocol.HEALTH_CHECK)
        self._config = None
        self._config_lock = asyncio.Lock()
        self._request_ids = itertools.count(1)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def wait_for_connected(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout)
        except asyncio.TimeoutError:
            raise PagedAttnError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"not connected to {self.options.target} within {timeout} s") from None

    async def _call(self, method, request, timeout=None):
        try:
            return await method(request, timeout=timeout or self.options.deadline(),
                                metadata=self.options.metadata(),
                                wait_for_ready=self.options.wait_for_ready)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    async def model_config(self, refresh: bool = False) -> ModelConfig:
        """GetModelConfig, fetched once and cached (refresh=True asks again)."""
        async with self._config_lock:
            if self._config is None or refresh:
                response = await self._call(self._stub.GetModelConfig, pb.GetModelConfigRequest())
                self._config = ModelConfig.from_message(response)
            return self._config

    async def create(self, sequence_id: int) -> None:
        request = pb.CreateSequenceRequest(sequence_id=_protocol.sequence_id(sequence_id))
        await self._call(self._stub.CreateSequence, request)

    async def append(self, sequence_id: int, layer: int, k, v,
                     num_tokens: Optional[int] = None) -> int:
        """AppendKV (see Client.append); returns the committed length after the call."""
        request = _protocol.append_request(await self.model_config(), sequence_id, layer, k, v,
                                           num_tokens)
        return (await self._call(self._stub.AppendKV, request)).length

    async def decode(self, layer: int, sequence_ids, q, k=None, v=None, sm_scale: float = 0.0,
                     timeout: Optional[float] = None, *, output: Optional[TensorRef] = None,
                     lse: Optional[TensorRef] = None) -> DecodeResult:
        """One unary Decode (see Client.decode; q, k, v may be TensorRefs, output / lse
        TensorRefs)."""
        config = await self.model_config()
        call = DecodeCall(layer, sequence_ids, q, k, v, sm_scale, output=output, lse=lse)
        request = _protocol.decode_request(config, call, next(self._request_ids))
        response = await self._call(self._stub.Decode, request, timeout)
        return _protocol.decode_result(config, request, response).check()

    async def fork(self, parent_id: int, child_id: int) -> None:
        request = pb.ForkSequenceRequest(parent_id=_protocol.sequence_id(parent_id, "parent_id"),
                                         child_id=_protocol.sequence_id(child_id, "child_id"))
        await self._call(self._stub.ForkSequence, request)

    async def release(self, sequence_id: int) -> None:
        request = pb.ReleaseSequenceRequest(sequence_id=_protocol.sequence_id(sequence_id))
        await self._call(self._stub.ReleaseSequence, request)

    # -- KV beyond one pool ------------------------------------------------------------------
    async def export_sequence(self, sequence_id: int, timeout: Optional[float] = None,
                              destination=None) -> List:
        """ExportSequence: the chunks (see Client.export_sequence, also for `destination`)."""
        request = _protocol.export_request(sequence_id, destination)
        try:
            call = self._stub.ExportSequence(request, timeout=timeout or self.options.deadline(),
                                             metadata=self.options.metadata(),
                                             wait_for_ready=self.options.wait_for_ready)
            return [chunk async for chunk in call]
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    async def import_sequence(self, sequence_id: int, chunks, timeout: Optional[float] = None) -> int:
        """ImportSequence (see Client.import_sequence); returns the committed length."""
        messages = list(_protocol.import_chunks(sequence_id, chunks))
        try:
            response = await self._stub.ImportSequence(
                iter(messages), timeout=timeout or self.options.deadline(),
                metadata=self.options.metadata(), wait_for_ready=self.options.wait_for_ready)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return response.length

    async def offload(self, sequence_id: int) -> None:
        """OffloadSequence (see Client.offload)."""
        await self._call(self._stub.OffloadSequence,
                         pb.OffloadSequenceRequest(sequence_id=_protocol.sequence_id(sequence_id)))

    async def stats(self) -> Stats:
        return Stats.from_message(await self._call(self._stub.GetStats, pb.GetStatsRequest()))

    async def register_system_memory(self, name: str, key: str, offset: int,
                                     byte_size: int) -> None:
        """RegisterSystemMemory (see Client.register_system_memory)."""
        await self._call(self._stub.RegisterSystemMemory,
                         _protocol.register_system_request(name, key, offset, byte_size))

    async def register_cuda_memory(self, name: str, raw_handle: bytes, device_id: int,
                                   byte_size: int) -> None:
        """RegisterCudaMemory (see Client.register_cuda_memory)."""
        await self._call(self._stub.RegisterCudaMemory,
                         _protocol.register_cuda_request(name, raw_handle, device_id, byte_size))

    async def unregister_memory(self, name: str, timeout: Optional[float] = None) -> None:
        """UnregisterMemory (see Client.unregister_memory)."""
        await self._call(self._stub.UnregisterMemory,
                         pb.UnregisterMemoryRequest(name=str(name)), timeout)

    async def list_memory(self) -> List[MemoryRegion]:
        return _protocol.memory_regions(await self._call(self._stub.ListMemory,
                                                         pb.ListMemoryRequest()))

    async def health(self, service: str = "") -> str:
        response = await self._call(self._health, _protocol.health_request(service))
        return _protocol.health_status(response)

    async def open_decode_stream(self) -> "AsyncDecodeStream":
        """A DecodeStream (no deadline); use `async with` or call close()."""
        config = await self.model_config()
        call = self._stub.DecodeStream(metadata=self.options.metadata(),
                                       wait_for_ready=self.options.wait_for_ready)
        return AsyncDecodeStream(call, config, self._request_ids)


class AsyncDecodeStream:
    """Several Decodes in flight on one stream: each `await stream.decode(...)` writes its
    request at once (requests are applied in the order they were written) and returns when its
    own response arrives; run them concurrently (asyncio.gather, tasks) to pipeline. A request
    that fails raises its own PagedAttnError and the stream goes on; a broken stream fails every
    pending decode with the stream's status."""

    def __init__(self, call, config: ModelConfig, request_ids):
        self._call = call
        self._config = config
        self._request_ids = request_ids
        self._pending = collections.deque()  # (request, future), in write order
        self._write_lock = asyncio.Lock()
        self._closed = False
        self._broken: Optional[PagedAttnError] = None
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        if exc[0] is None:
            await self.close()
        else:
            self.cancel()

    async def decode(self, layer: int, sequence_ids, q, k=None, v=None, sm_scale: float = 0.0,
                     *, output: Optional[TensorRef] = None,
                     lse: Optional[TensorRef] = None) -> DecodeResult:
        return await self.submit(DecodeCall(layer, sequence_ids, q, k, v, sm_scale,
                                            output=output, lse=lse))

    async def submit(self, call: DecodeCall) -> DecodeResult:
        request_id = call.request_id if call.request_id is not None else next(self._request_ids)
        request = _protocol.decode_request(self._config, call, request_id)
        future = asyncio.get_running_loop().create_future()
        async with self._write_lock:
            if self._broken is not None:
                raise self._broken
            if self._closed:
                raise PagedAttnError(grpc.StatusCode.FAILED_PRECONDITION, "the stream is closed")
            self._pending.append((request, future))
            try:
                await self._call.write(request)
            except grpc.RpcError as e:
                self._fail(from_rpc_error(e))
            except asyncio.InvalidStateError:
                self._fail(PagedAttnError(grpc.StatusCode.UNAVAILABLE, "the stream has ended"))
        result = await future
        return result.check()

    async def _read(self):
        try:
            while True:
                response = await self._call.read()
                if response is grpc.aio.EOF:
                    break
                if not self._pending:
                    raise PagedAttnError(grpc.StatusCode.INTERNAL, "a response without a request")
                request, future = self._pending.popleft()
                if response.request_id != request.request_id:
                    raise PagedAttnError(grpc.StatusCode.INTERNAL,
                                         f"response {response.request_id} for request "
                                         f"{request.request_id}")
                try:
                    result = _protocol.decode_result(self._config, request, response)
                except PagedAttnError as e:
                    result = DecodeResult(request_id=response.request_id, error=e)
                if not future.done():
                    future.set_result(result)
            code = await self._call.code()
            if code != grpc.StatusCode.OK:
                self._fail(PagedAttnError(code, await self._call.details()))
            elif self._pending:
                self._fail(PagedAttnError(grpc.StatusCode.INTERNAL,
                                          "the stream ended before answering every request"))
        except grpc.RpcError as e:
            self._fail(from_rpc_error(e))
        except PagedAttnError as e:
            self._fail(e)
            self._call.cancel()
        except asyncio.CancelledError:
            self._fail(PagedAttnError(grpc.StatusCode.CANCELLED, "the stream was cancelled"))
            raise

    def _fail(self, error: PagedAttnError) -> None:
        self._broken = self._broken or error
        while self._pending:
            _, future = self._pending.popleft()
            if not future.done():
                future.set_exception(error)

    async def close(self) -> None:
        """Half-closes, waits for every pending response, then ends the stream; raises the
        stream's error if it broke."""
        async with self._write_lock:
            if not self._closed:
                self._closed = True
                if self._broken is None:
                    try:
                        await self._call.done_writing()
                    except grpc.RpcError:
                        pass  # the reader reports the stream's status
        await asyncio.wait([self._reader])  # its outcome is in self._broken
        if self._broken is not None:
            raise self._broken

    def cancel(self) -> None:
        """Cancels the stream: pending and later decodes fail with CANCELLED."""
        self._closed = True
        self._fail(PagedAttnError(grpc.StatusCode.CANCELLED, "the stream was cancelled"))
        self._call.cancel()
