"""Client: the synchronous client of pagedattn.v1.PagedAttention (grpc).

Thread-safe: any number of threads may share one Client (gRPC multiplexes the calls on one
channel). Every failure raises PagedAttnError with the call's gRPC status code.
"""

import collections
import itertools
import threading
from typing import Iterable, Iterator, List, Optional

import grpc

from . import _protocol
from .errors import PagedAttnError, from_rpc_error
from .options import ClientOptions, make_options
from .types import DecodeCall, DecodeResult, MemoryRegion, ModelConfig, Stats, TensorRef
from .v1 import pagedattn_pb2 as pb
from .v1 import pagedattn_pb2_grpc as pb_grpc


class Client:
    """Client("host:port", bearer_token=..., tls_ca_file=..., ...): keyword arguments are the
    fields of ClientOptions (or pass options=ClientOptions(...)). The channel connects lazily;
    wait_for_connected() waits for it. Use as a context manager, or call close()."""

    def __init__(self, target: Optional[str] = None, *, options: Optional[ClientOptions] = None,
                 **fields):
        self.options = make_options(target, options, fields)
        credentials = self.options.credentials()
        args = self.options.channel_arguments()
        self._channel = (grpc.secure_channel(self.options.target, credentials, options=args)
                         if credentials else
                         grpc.insecure_channel(self.options.target, options=args))
        self._stub = pb_grpc.PagedAttentionStub(self._channel)
        self._health = self._channel.unary_unary(_protocol.HEALTH_CHECK)
        self._config = None
        self._config_lock = threading.Lock()
        self._request_ids = itertools.count(1)

    # -- connection -------------------------------------------------------------------------
    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def wait_for_connected(self, timeout: float) -> None:
        """Blocks until the channel is connected; DEADLINE_EXCEEDED after `timeout` seconds."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise PagedAttnError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"not connected to {self.options.target} within {timeout} s") from None

    def _call(self, method, request, timeout=None):
        try:
            return method(request, timeout=timeout or self.options.deadline(),
                          metadata=self.options.metadata(),
                          wait_for_ready=self.options.wait_for_ready)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    # -- the service ------------------------------------------------------------------------
    def model_config(self, refresh: bool = False) -> ModelConfig:
        """GetModelConfig, fetched once and cached (refresh=True asks again). Every shape the
        client checks comes from it."""
        with self._config_lock:
            if self._config is None or refresh:
                response = self._call(self._stub.GetModelConfig, pb.GetModelConfigRequest())
                self._config = ModelConfig.from_message(response)
            return self._config

    @property
    def config(self) -> ModelConfig:
        return self.model_config()

    def create(self, sequence_id: int) -> None:
        """An empty sequence. ALREADY_EXISTS if the id is in use."""
        request = pb.CreateSequenceRequest(sequence_id=_protocol.sequence_id(sequence_id))
        self._call(self._stub.CreateSequence, request)

    def append(self, sequence_id: int, layer: int, k, v, num_tokens: Optional[int] = None) -> int:
        """AppendKV: k, v [num_tokens, num_kv_heads, head_dim] into one layer (one step's layer;
        walk layers 0..num_layers-1 in order). Returns the committed length after the call (it
        grows at the last layer). k, v may be TensorRefs; when both are, num_tokens defaults
        to what k's byte_size holds."""
        request = _protocol.append_request(self.config, sequence_id, layer, k, v, num_tokens)
        return self._call(self._stub.AppendKV, request).length

    def decode(self, layer: int, sequence_ids, q, k=None, v=None, sm_scale: float = 0.0,
               timeout: Optional[float] = None, *, output: Optional[TensorRef] = None,
               lse: Optional[TensorRef] = None) -> DecodeResult:
        """One Decode: q [B, num_qo_heads, head_dim]; k, v [B, num_kv_heads, head_dim] (both: a
        decode step writing each sequence's new token; neither: attend only). Any of q, k, v
        may be a TensorRef; output / lse TensorRefs make the server write the results there
        (complete when this returns) and the result's fields None."""
        call = DecodeCall(layer, sequence_ids, q, k, v, sm_scale, output=output, lse=lse)
        request = _protocol.decode_request(self.config, call, next(self._request_ids))
        response = self._call(self._stub.Decode, request, timeout)
        return _protocol.decode_result(self.config, request, response).check()

    def decode_stream(self, calls: Iterable[DecodeCall]) -> Iterator[DecodeResult]:
        """DecodeStream: sends `calls` (any iterable, consumed lazily on gRPC's thread, so the
        server pipelines them) and yields one DecodeResult per call, in order. A call that
        fails yields a result with `error` set and the stream goes on; a broken stream raises
        PagedAttnError. A bad call (shape, dtype) raises before it is sent and ends the
        stream."""
        config = self.config
        sent = collections.deque()  # requests handed to gRPC and not yet answered, oldest first
        failure = []

        def requests():
            for call in calls:
                request_id = call.request_id
                if request_id is None:
                    request_id = next(self._request_ids)
                try:
                    request = _protocol.decode_request(config, call, request_id)
                except PagedAttnError as e:
                    failure.append(e)
                    return
                sent.append(request)
                yield request

        responses = self._stub.DecodeStream(requests(), metadata=self.options.metadata(),
                                            wait_for_ready=self.options.wait_for_ready)
        try:
            for response in responses:
                request = sent.popleft()
                yield _protocol.decode_result(config, request, response)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            responses.cancel()
        if failure:
            raise failure[0]

    def fork(self, parent_id: int, child_id: int) -> None:
        """child_id shares every page of parent_id (copy on write)."""
        request = pb.ForkSequenceRequest(parent_id=_protocol.sequence_id(parent_id, "parent_id"),
                                         child_id=_protocol.sequence_id(child_id, "child_id"))
        self._call(self._stub.ForkSequence, request)

    def release(self, sequence_id: int) -> None:
        """Frees a sequence. NOT_FOUND if unknown (also for a second release)."""
        request = pb.ReleaseSequenceRequest(sequence_id=_protocol.sequence_id(sequence_id))
        self._call(self._stub.ReleaseSequence, request)

    # -- KV beyond one pool ------------------------------------------------------------------
    def export_sequence(self, sequence_id: int, timeout: Optional[float] = None,
                        destination: Optional[TensorRef] = None) -> List[pb.ExportSequenceChunk]:
        """ExportSequence: every chunk of the sequence's committed tokens (k/v bytes as the
        pool stores them, layer by layer, at most 2 MiB each; the first names the pages' type
        and fp8 scales). With `destination` (a TensorRef into a region registered here, e.g.
        SystemRegion.ref(0, region.size)) the server writes the rows there instead: layer after
        layer, K then V, each [length, num_kv_heads, head_dim] as stored, and the chunks (one per
        layer) carry k_ref / v_ref naming them, with empty k / v."""
        request = _protocol.export_request(sequence_id, destination)
        try:
            return list(self._stub.ExportSequence(request, timeout=timeout or self.options.deadline(),
                                                  metadata=self.options.metadata(),
                                                  wait_for_ready=self.options.wait_for_ready))
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def import_sequence(self, sequence_id: int, chunks, timeout: Optional[float] = None) -> int:
        """ImportSequence: a new sequence `sequence_id` from exported chunks (of this server or
        another); returns its committed length. Nothing is created unless every chunk arrives.
        A chunk's rows may be by reference (k_ref / v_ref, as an export into a region gives
        them): the region must be registered on this server under that name (e.g. one
        SystemRegion registered with both servers), and stay unchanged until this returns."""
        return self._call(self._stub.ImportSequence, _protocol.import_chunks(sequence_id, chunks),
                          timeout).length

    def offload(self, sequence_id: int) -> None:
        """OffloadSequence: moves an idle sequence to the server's host tier; its next append or
        decode brings it back."""
        self._call(self._stub.OffloadSequence,
                   pb.OffloadSequenceRequest(sequence_id=_protocol.sequence_id(sequence_id)))

    def stats(self) -> Stats:
        return Stats.from_message(self._call(self._stub.GetStats, pb.GetStatsRequest()))

    # -- memory regions (tensors by reference; SystemRegion and CudaRegion wrap these) ---------
    def register_system_memory(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """RegisterSystemMemory: bytes [offset, offset + byte_size) of the POSIX shared-memory
        object `key` ("/name") become region `name`. ALREADY_EXISTS, RESOURCE_EXHAUSTED,
        FAILED_PRECONDITION (the server cannot open or map it), INVALID_ARGUMENT."""
        self._call(self._stub.RegisterSystemMemory,
                   _protocol.register_system_request(name, key, offset, byte_size))

    def register_cuda_memory(self, name: str, raw_handle: bytes, device_id: int,
                             byte_size: int) -> None:
        """RegisterCudaMemory: the first byte_size bytes of the CUDA allocation whose
        cudaIpcMemHandle_t is `raw_handle` (64 bytes) become region `name`."""
        self._call(self._stub.RegisterCudaMemory,
                   _protocol.register_cuda_request(name, raw_handle, device_id, byte_size))

    def unregister_memory(self, name: str, timeout: Optional[float] = None) -> None:
        """UnregisterMemory: unlists `name` at once and returns once no queued or running work
        uses it (DEADLINE_EXCEEDED if that takes longer than the deadline; it is unmapped
        later all the same). NOT_FOUND for an unknown name."""
        self._call(self._stub.UnregisterMemory, pb.UnregisterMemoryRequest(name=str(name)),
                   timeout)

    def list_memory(self) -> List[MemoryRegion]:
        """ListMemory: the registered regions, sorted by name."""
        return _protocol.memory_regions(self._call(self._stub.ListMemory,
                                                   pb.ListMemoryRequest()))

    def health(self, service: str = "") -> str:
        """grpc.health.v1 Check: "SERVING" or "NOT_SERVING" ("" is the whole server,
        "pagedattn.v1.PagedAttention" the service)."""
        return _protocol.health_status(self._call(self._health, _protocol.health_request(service)))
