"""Tensors in and out of the wire format, shape-checked against the server's ModelConfig.

The wire's element type is the server's dtype (ModelConfig.dtype): bf16 or fp16, 2 bytes each.
Accepted as input:
  - numpy arrays of float16/float32/float64 (converted to the dtype, round to nearest even;
    float64 is rounded to float32 first); with fp16, float16 arrays are sent unchanged;
  - numpy uint16 arrays, taken as bit patterns of the dtype and sent unchanged (also ml_dtypes'
    bfloat16 arrays, viewed as their bits, with bf16);
  - torch tensors, when torch is imported by the caller: tensors of the dtype (bfloat16 or
    float16) are sent bit for bit, other floating tensors are converted like numpy arrays. A
    CUDA tensor is copied to the host first (synchronously); a CudaRegion
    (pagedattn.regions, tensors by reference) avoids that copy.
Anything else, or a shape other than the one the config implies, is INVALID_ARGUMENT before
anything is sent.
"""

import sys

import grpc
import numpy as np

from . import bf16
from .errors import PagedAttnError, invalid_argument


DTYPES = ("bf16", "fp16")


def _torch_bits_or_floats(x, dtype: str):
    """A torch tensor -> (uint16 bits of dtype or None, float array or None), on the host."""
    torch = sys.modules["torch"]
    t = x.detach()
    if t.dtype == (torch.bfloat16 if dtype == "bf16" else torch.float16):
        return t.to("cpu").contiguous().view(torch.int16).numpy().view(np.uint16), None
    if not t.is_floating_point():
        raise invalid_argument(f"tensor of dtype {t.dtype}: expected a floating dtype")
    return None, t.to(device="cpu", dtype=torch.float32).contiguous().numpy()


def _is_torch_tensor(x) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _float_bits(floats, dtype: str) -> np.ndarray:
    """Floats -> uint16 bits of dtype (float64 rounded to float32 first)."""
    if dtype == "bf16":
        return bf16.to_bits(floats)
    f32 = np.ascontiguousarray(floats, dtype=np.float32)
    return f32.astype(np.float16).view(np.uint16)


def as_bits(x, shape, name: str, dtype: str = "bf16") -> np.ndarray:
    """x (see the module doc) -> contiguous uint16 bits of `dtype` of exactly `shape`."""
    if dtype not in DTYPES:
        raise invalid_argument(f"element type {dtype!r}: expected one of {DTYPES}")
    if x is None:
        raise invalid_argument(f"{name} is missing")
    if _is_torch_tensor(x):
        bits, floats = _torch_bits_or_floats(x, dtype)
    elif isinstance(x, np.ndarray):
        bits = floats = None
        if x.dtype == np.uint16:
            bits = x
        elif x.dtype.name == "bfloat16" and dtype == "bf16":
            bits = x.view(np.uint16)
        elif x.dtype == np.float16 and dtype == "fp16":
            bits = x.view(np.uint16)
        elif np.issubdtype(x.dtype, np.floating):
            floats = x
        else:
            raise invalid_argument(f"{name} has dtype {x.dtype}: expected float16/32/64, uint16 "
                                   "(bf16 bits) or bfloat16")
    else:
        raise invalid_argument(f"{name} is a {type(x).__name__}: expected a numpy array or a "
                               "torch tensor")
    got = tuple((bits if bits is not None else floats).shape)
    if got != tuple(shape):
        raise invalid_argument(f"{name} has shape {got}, expected {tuple(shape)}")
    return np.ascontiguousarray(bits) if bits is not None else _float_bits(floats, dtype)


def as_bf16_bits(x, shape, name: str) -> np.ndarray:
    return as_bits(x, shape, name, "bf16")


def to_wire(x, shape, name: str, dtype: str = "bf16") -> bytes:
    """x -> the wire's bytes of `dtype`, checked against `shape`."""
    return bf16.encode(as_bits(x, shape, name, dtype))


def from_bits(bits, dtype: str = "bf16") -> np.ndarray:
    """uint16 bits of dtype -> float32, exactly."""
    if dtype == "bf16":
        return bf16.from_bits(bits)
    return np.asarray(bits, dtype=np.uint16).view(np.float16).astype(np.float32)


def output_from_wire(data: bytes, shape, dtype: str = "bf16") -> np.ndarray:
    """DecodeResponse.output -> float32 of `shape` (exact: every bf16 and fp16 is a float32)."""
    expected = int(np.prod(shape)) * 2
    if len(data) != expected:
        raise PagedAttnError(grpc.StatusCode.INTERNAL,
                             f"the server sent an output of {len(data)} bytes, expected {expected}")
    return from_bits(bf16.decode(data, shape), dtype)


def lse_from_wire(data: bytes, shape) -> np.ndarray:
    expected = int(np.prod(shape)) * 4
    if len(data) != expected:
        raise PagedAttnError(grpc.StatusCode.INTERNAL,
                             f"the server sent an lse of {len(data)} bytes, expected {expected}")
    return bf16.decode_float32(data, shape)
