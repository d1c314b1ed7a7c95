"""Requests and responses of pagedattn.v1, shared by Client and AsyncClient: tensors are
converted and shape-checked here, so both clients refuse the same bad input the same way."""

import numpy as np

from . import tensors
from .errors import from_code, invalid_argument
from .types import DecodeCall, DecodeResult, ModelConfig
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


def append_request(config: ModelConfig, seq, layer, k, v) -> pb.AppendKVRequest:
    """k, v: [num_tokens, num_kv_heads, head_dim]; num_tokens is taken from k's first axis."""
    seq = sequence_id(seq)
    shape = getattr(k, "shape", None)
    if shape is None or len(shape) < 1:
        raise invalid_argument("k must be an array of shape [num_tokens, num_kv_heads, head_dim]")
    n = int(shape[0])
    kv_shape = config.kv_shape(n)
    return pb.AppendKVRequest(sequence_id=seq, layer=int(layer), num_tokens=n,
                              k=tensors.to_wire(k, kv_shape, "k"),
                              v=tensors.to_wire(v, kv_shape, "v"))


def decode_request(config: ModelConfig, call: DecodeCall, request_id: int) -> pb.DecodeRequest:
    ids = [sequence_id(s, "sequence id") for s in call.sequence_ids]
    b = len(ids)
    request = pb.DecodeRequest(request_id=request_id, layer=int(call.layer), sequence_ids=ids,
                               q=tensors.to_wire(call.q, config.q_shape(b), "q"),
                               sm_scale=float(call.sm_scale))
    if (call.k is None) != (call.v is None):
        raise invalid_argument("k and v go together: give both (a decode step) or neither")
    if call.k is not None:
        request.k = tensors.to_wire(call.k, config.kv_shape(b), "k")
        request.v = tensors.to_wire(call.v, config.kv_shape(b), "v")
    return request


def decode_result(config: ModelConfig, request: pb.DecodeRequest, response) -> DecodeResult:
    """A unary response or a stream response (whose own error becomes result.error)."""
    if response.error_code != 0:
        return DecodeResult(request_id=response.request_id,
                            error=from_code(response.error_code, response.error_message))
    b = len(request.sequence_ids)
    return DecodeResult(request_id=response.request_id,
                        output=tensors.output_from_wire(response.output, config.q_shape(b)),
                        lse=tensors.lse_from_wire(response.lse, config.lse_shape(b)))


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
