"""Requests and responses of pagedattn.v1, shared by Client and AsyncClient: tensors are
converted and shape-checked here, so both clients refuse the same bad input the same way."""

import numpy as np

from . import tensors
from .errors import from_code, invalid_argument
from .types import DecodeCall, DecodeResult, MemoryRegion, ModelConfig, TensorRef
from .v1 import pagedattn_pb2 as pb

_UINT64_LIMIT = 1 << 64
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
# grpc.health.v1.HealthCheckResponse.ServingStatus
_HEALTH_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def sequence_id(value, name="sequence_id") -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise invalid_argument(f"{name} must be an integer, got {type(value).__name__}")
    if not 0 <= int(value) < _UINT64_LIMIT:
        raise invalid_argument(f"{name} {value} is outside [0, 2^64)")
    return int(value)


def _is_ref(x) -> bool:
    return isinstance(x, TensorRef)


def _ref(x, name: str):
    if not _is_ref(x):
        raise invalid_argument(f"{name} must be a TensorRef (a place in a registered memory "
                               f"region), got {type(x).__name__}")
    return x.to_message()


def _set_tensor(request, name: str, x, shape, dtype: str) -> None:
    """One input of a request: inline bytes of the server's dtype, or `<name>_ref` for a
    TensorRef (whose size the server checks)."""
    if _is_ref(x):
        getattr(request, name + "_ref").CopyFrom(x.to_message())
    else:
        setattr(request, name, tensors.to_wire(x, shape, name, dtype))


def append_request(config: ModelConfig, seq, layer, k, v,
                   num_tokens=None) -> pb.AppendKVRequest:
    """k, v: [num_tokens, num_kv_heads, head_dim] arrays or TensorRefs. num_tokens comes from
    an array's first axis; when both are refs, from num_tokens or else k's byte_size."""
    seq = sequence_id(seq)
    n = num_tokens
    if n is None:
        array = next((x for x in (k, v) if x is not None and not _is_ref(x)), None)
        if array is not None:
            shape = getattr(array, "shape", None)
            if shape is None or len(shape) < 1:
                raise invalid_argument(
                    "k and v must be arrays of shape [num_tokens, num_kv_heads, head_dim]")
            n = int(shape[0])
        elif _is_ref(k):
            n = int(k.byte_size) // (2 * config.num_kv_heads * config.head_dim)
        else:
            raise invalid_argument("k is missing")
    request = pb.AppendKVRequest(sequence_id=seq, layer=int(layer), num_tokens=int(n))
    _set_tensor(request, "k", k, config.kv_shape(n), config.dtype)
    _set_tensor(request, "v", v, config.kv_shape(n), config.dtype)
    return request


def decode_request(config: ModelConfig, call: DecodeCall, request_id: int) -> pb.DecodeRequest:
    ids = [sequence_id(s, "sequence id") for s in call.sequence_ids]
    b = len(ids)
    request = pb.DecodeRequest(request_id=request_id, layer=int(call.layer), sequence_ids=ids,
                               sm_scale=float(call.sm_scale))
    _set_tensor(request, "q", call.q, config.q_shape(b), config.dtype)
    if (call.k is None) != (call.v is None):
        raise invalid_argument("k and v go together: give both (a decode step) or neither")
    if call.k is not None:
        _set_tensor(request, "k", call.k, config.kv_shape(b), config.dtype)
        _set_tensor(request, "v", call.v, config.kv_shape(b), config.dtype)
    if call.output is not None:
        request.output_ref.CopyFrom(_ref(call.output, "output"))
    if call.lse is not None:
        request.lse_ref.CopyFrom(_ref(call.lse, "lse"))
    return request


def decode_result(config: ModelConfig, request: pb.DecodeRequest, response) -> DecodeResult:
    """A unary response or a stream response (whose own error becomes result.error). An
    output or lse the request placed in a region is None here."""
    if response.error_code != 0:
        return DecodeResult(request_id=response.request_id,
                            error=from_code(response.error_code, response.error_message))
    b = len(request.sequence_ids)
    output = lse = None
    if not request.HasField("output_ref"):
        output = tensors.output_from_wire(response.output, config.q_shape(b), config.dtype)
    if not request.HasField("lse_ref"):
        lse = tensors.lse_from_wire(response.lse, config.lse_shape(b))
    return DecodeResult(request_id=response.request_id, output=output, lse=lse)


# Memory regions (tensors by reference).
def register_system_request(name, key, offset, byte_size) -> pb.RegisterSystemMemoryRequest:
    return pb.RegisterSystemMemoryRequest(name=str(name), key=str(key), offset=int(offset),
                                          byte_size=int(byte_size))


def register_cuda_request(name, raw_handle, device_id, byte_size) -> pb.RegisterCudaMemoryRequest:
    return pb.RegisterCudaMemoryRequest(name=str(name), raw_handle=bytes(raw_handle),
                                        device_id=int(device_id), byte_size=int(byte_size))


def memory_regions(response) -> list:
    return [MemoryRegion.from_message(r) for r in response.regions]


# grpc.health.v1 messages, by hand (two fields) so that no health stubs are needed.
def health_request(service: str) -> bytes:
    name = service.encode()
    if len(name) > 127:
        raise invalid_argument("service name longer than 127 bytes")
    return (b"\x0a" + bytes([len(name)]) + name) if name else b""


def health_status(response: bytes) -> str:
    """HealthCheckResponse bytes -> "SERVING", "NOT_SERVING", ... (field 1, a varint enum)."""
    status, i = 0, 0
    while i < len(response):
        tag = response[i]
        i += 1
        if tag & 7 != 0:  # only varint fields are expected
            raise ValueError(f"unexpected wire type in a health response: {response!r}")
        value, shift = 0, 0
        while True:
            byte = response[i]
            i += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        if tag >> 3 == 1:
            status = value
    return _HEALTH_NAMES.get(status, str(status))


def import_chunks(new_id: int, chunks):
    """ImportSequenceChunk messages from exported chunks (ExportSequenceChunk or
    ImportSequenceChunk, k/v inline or by reference): the first names `new_id` and the chunks'
    length."""
    new_id = sequence_id(new_id)
    for i, c in enumerate(chunks):
        out = pb.ImportSequenceChunk(layer=c.layer, first_token=c.first_token,
                                     num_tokens=c.num_tokens, k=c.k, v=c.v)
        # Rows by reference (an export into a region) pass as they are: the region must be
        # registered on the importing server under the same name.
        if c.HasField("k_ref"):
            out.k_ref.CopyFrom(c.k_ref)
        if c.HasField("v_ref"):
            out.v_ref.CopyFrom(c.v_ref)
        if i == 0:
            out.sequence_id = new_id
            out.length = c.length
            out.kv_cache_dtype = c.kv_cache_dtype
            out.k_scale.extend(c.k_scale)
            out.v_scale.extend(c.v_scale)
        yield out


def export_request(sequence_id_: int, destination) -> "pb.ExportSequenceRequest":
    """An ExportSequenceRequest, into `destination` (a TensorRef) when given."""
    request = pb.ExportSequenceRequest(sequence_id=sequence_id(sequence_id_))
    if destination is not None:
        request.destination.CopyFrom(destination.to_message())
    return request
