"""bf16 as the pagedattn.v1 messages carry it: the upper 16 bits of an IEEE-754 binary32,
little-endian. The conversion is the C++ client's (client/bf16.cc), vectorised with numpy:
float32 -> bf16 rounds to nearest, ties to even; a NaN stays a quiet NaN with its sign and upper
payload bits; bf16 -> float32 is exact.
"""

import numpy as np

_LE_U16 = np.dtype("<u2")
_LE_F32 = np.dtype("<f4")


def to_bits(values) -> np.ndarray:
    """Floats (any shape; float64 is rounded to float32 first) -> bf16 bit patterns (uint16)."""
    f = np.ascontiguousarray(values, dtype=np.float32)
    u = f.view(np.uint32)
    # Every non-NaN pattern is <= 0xFF800000, so the addition below never wraps.
    rounded = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    quiet_nan = (u >> np.uint32(16)) | np.uint32(0x0040)
    return np.where(np.isnan(f), quiet_nan, rounded).astype(np.uint16)


def from_bits(bits) -> np.ndarray:
    """bf16 bit patterns (uint16, any shape) -> float32, exactly."""
    b = np.asarray(bits)
    if b.dtype != np.uint16:
        raise TypeError(f"bf16 bit patterns must be uint16, got {b.dtype}")
    return (b.astype(np.uint32) << np.uint32(16)).view(np.float32)


def encode(bits) -> bytes:
    """bf16 bit patterns -> the wire's little-endian bytes (2 per value)."""
    return np.ascontiguousarray(bits, dtype=np.uint16).astype(_LE_U16, copy=False).tobytes()


def decode(data: bytes, shape=None) -> np.ndarray:
    """Wire bytes -> bf16 bit patterns (uint16, native order), reshaped when shape is given."""
    bits = np.frombuffer(data, dtype=_LE_U16).astype(np.uint16)
    return bits if shape is None else bits.reshape(shape)


def decode_float32(data: bytes, shape=None) -> np.ndarray:
    """fp32 wire bytes (e.g. DecodeResponse.lse) -> float32, reshaped when shape is given."""
    values = np.frombuffer(data, dtype=_LE_F32).astype(np.float32)
    return values if shape is None else values.reshape(shape)
