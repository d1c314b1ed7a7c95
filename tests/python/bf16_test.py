"""pagedattn.bf16 and pagedattn.tensors: the numpy conversion against the C++ client's own
(bf16_reference, built from client/bf16.cc) bit for bit, over every bf16 pattern, the rounding
boundaries of every one of them and a million random float32 patterns (NaNs, infinities and
subnormals included); the tensor input rules; torch tensors when torch is installed.

usage: /usr/bin/python3 bf16_test.py --package=BUILD/python --reference=BIN
"""

import subprocess
import unittest

import numpy as np

import package_testing as t


def cpp(mode, data: bytes) -> bytes:
    return subprocess.run([t.ARGS.reference, mode], input=data, capture_output=True,
                          check=True, timeout=60).stdout


def interesting_float32_bits():
    """Every upper half with the lower halves around the rounding point (ties to even, just
    below, just above), then random patterns."""
    high = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    lows = np.array([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=np.uint32)
    edges = (high[:, None] | lows[None, :]).ravel()
    rng = np.random.default_rng(20261204)
    randoms = rng.integers(0, 1 << 32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([edges, randoms])


class Bf16Test(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import pagedattn  # pylint: disable=import-outside-toplevel
        cls.bf16 = pagedattn.bf16
        cls.tensors = pagedattn.tensors
        cls.error = pagedattn.PagedAttnError

    def test_float32_to_bf16_matches_the_cpp_client_bit_for_bit(self):
        bits = interesting_float32_bits()
        floats = bits.view(np.float32)
        want = np.frombuffer(cpp("encode", floats.astype("<f4").tobytes()), dtype="<u2")
        got = self.bf16.to_bits(floats)
        mismatch = np.flatnonzero(got != want)
        self.assertEqual(len(mismatch), 0,
                         f"{len(mismatch)} differ, first float32 bits "
                         f"{[hex(int(bits[i])) for i in mismatch[:5]]}")
        self.assertEqual(self.bf16.encode(got), self.bf16.encode(want.astype(np.uint16)))
        # The cases the rule is about, spelled out.
        one = self.bf16.to_bits
        self.assertEqual(int(one(np.float32(1.0 + 2**-8))[0]), 0x3F80)  # a tie: to even (down)
        self.assertEqual(int(one(np.float32(1.0 + 3 * 2**-8))[0]), 0x3F82)  # a tie: to even (up)
        self.assertEqual(int(one(np.float32(np.inf))[0]), 0x7F80)
        self.assertEqual(int(one(np.float32(3.4e38))[0]), 0x7F80)  # rounds up to infinity
        nan = np.array([0x7F800001, 0xFFC00000, 0x7FFFFFFF], dtype=np.uint32).view(np.float32)
        self.assertTrue(np.isnan(self.bf16.from_bits(self.bf16.to_bits(nan))).all())

    def test_bf16_to_float32_matches_the_cpp_client_and_round_trips(self):
        every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
        want = np.frombuffer(cpp("decode", self.bf16.encode(every)), dtype="<u4")
        got = self.bf16.from_bits(every)
        np.testing.assert_array_equal(got.view(np.uint32), want)
        finite = ~np.isnan(got)
        np.testing.assert_array_equal(self.bf16.to_bits(got)[finite], every[finite])

    def test_wire_bytes_are_little_endian(self):
        bits = np.array([0x1234, 0xABCD], dtype=np.uint16)
        self.assertEqual(self.bf16.encode(bits), b"\x34\x12\xcd\xab")
        np.testing.assert_array_equal(self.bf16.decode(b"\x34\x12\xcd\xab"), bits)
        lse = np.array([1.5, -np.inf], dtype=np.float32)
        np.testing.assert_array_equal(self.bf16.decode_float32(lse.astype("<f4").tobytes()), lse)

    def test_tensor_inputs(self):
        rng = np.random.default_rng(7)
        x = rng.standard_normal((3, 4, 5)).astype(np.float32)
        bits = self.bf16.to_bits(x)
        reversed_twice = x[:, :, ::-1][:, :, ::-1]
        for form in (x, x.astype(np.float64), bits, np.asfortranarray(x), reversed_twice):
            np.testing.assert_array_equal(self.tensors.as_bf16_bits(form, (3, 4, 5), "x"), bits)
        wire = self.tensors.to_wire(x, (3, 4, 5), "x")
        self.assertEqual(len(wire), 3 * 4 * 5 * 2)
        np.testing.assert_array_equal(self.tensors.output_from_wire(wire, (3, 4, 5)),
                                      self.bf16.from_bits(bits))
        for bad in (x.reshape(3, 20), x.astype(np.int32), x.tolist(), b"\0" * 120, None):
            with self.assertRaises(self.error) as ctx:
                self.tensors.as_bf16_bits(bad, (3, 4, 5), "x")
            self.assertEqual(ctx.exception.code.name, "INVALID_ARGUMENT")

    def test_torch_tensors(self):
        try:
            import torch  # pylint: disable=import-outside-toplevel
        except ImportError:
            self.skipTest("torch is not installed: the torch input path is not exercised here")
        rng = np.random.default_rng(8)
        x = rng.standard_normal((2, 3, 4)).astype(np.float32)
        want = self.bf16.to_bits(x)
        forms = [torch.from_numpy(x), torch.from_numpy(x).to(torch.bfloat16),
                 torch.from_numpy(x).double(), torch.from_numpy(x).requires_grad_()]
        if torch.cuda.is_available():
            forms += [f.cuda() for f in forms[:2]]
        for form in forms:
            np.testing.assert_array_equal(self.tensors.as_bf16_bits(form, (2, 3, 4), "x"), want,
                                          err_msg=f"{form.dtype} on {form.device}")
        with self.assertRaises(self.error):
            self.tensors.as_bf16_bits(torch.zeros(2, 3, 4, dtype=torch.int32), (2, 3, 4), "x")


if __name__ == "__main__":
    t.main([("--reference", {"required": True})])
