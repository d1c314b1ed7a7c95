"""The Python client against servers started with other model shapes: the config reports the
shape and the element type, tensors go over the wire in that type (fp16 here: numpy float16
arrays bit for bit, other floats rounded), inline and through a system region, and every decode
matches the numpy reference.

usage: /usr/bin/python3 model_shapes_test.py --server=BIN --package=BUILD/python
"""

import unittest

import numpy as np

import package_testing as t


def random_fp16(rng, shape):
    """Normal(0, 1) values as float16 (exact in float32, as the server sees them)."""
    return rng.standard_normal(shape, np.float32).astype(np.float16)


class Fp16SmallHeadsTest(t.ServerCase):
    """Llama-3.2-1B-like heads at fp16 with head_dim 64 and pages of 16."""
    LAYERS, PAGES = 2, 64
    SERVER_FLAGS = ("--num_qo_heads=8", "--num_kv_heads=2", "--head_dim=64", "--page_size=16",
                    "--dtype=fp16")

    def test_config_reports_the_shape_and_types(self):
        c = self.config
        self.assertEqual((c.num_qo_heads, c.num_kv_heads, c.head_dim, c.page_size), (8, 2, 64, 16))
        self.assertEqual((c.dtype, c.kv_cache_dtype), ("fp16", "fp16"))

    def test_appends_and_steps_match_the_reference(self):
        mirror = t.Mirror(self.config)
        sids = [11, 12, 13]
        for i, sid in enumerate(sids):
            self.client.create(sid)
            mirror.create(sid)
            for layer in range(self.LAYERS):
                n = [1, 17, 40][i]
                k = random_fp16(self.rng, self.config.kv_shape(n))
                # float32 input is rounded to fp16 by the client; float16 goes as is.
                v = random_fp16(self.rng, self.config.kv_shape(n)).astype(np.float32)
                self.client.append(sid, layer, k, v)
                mirror.append(sid, layer, k.astype(np.float32), v)
        for layer in range(self.LAYERS):
            b = len(sids)
            q = random_fp16(self.rng, self.config.q_shape(b))
            k = random_fp16(self.rng, self.config.kv_shape(b))
            v = random_fp16(self.rng, self.config.kv_shape(b))
            result = self.client.decode(layer, sids, q, k, v)
            for i, sid in enumerate(sids):
                mirror.append(sid, layer, k[i:i + 1].astype(np.float32),
                              v[i:i + 1].astype(np.float32))
            want = mirror.expected(layer, sids, q.astype(np.float32), True)
            t.assert_matches(self, result, want, f"fp16 step at layer {layer}")

    def test_a_decode_through_a_system_region_in_fp16(self):
        self.client.create(21)
        k = random_fp16(self.rng, self.config.kv_shape(20))
        v = random_fp16(self.rng, self.config.kv_shape(20))
        for layer in range(self.LAYERS):
            self.client.append(21, layer, k, v)
        q = random_fp16(self.rng, self.config.q_shape(1))
        with self.pa.SystemRegion(1 << 16, self.client) as region:
            q_ref = region.put(q, dtype="fp16")
            out_ref = region.alloc(q.nbytes)
            inline = self.client.decode(0, [21], q)
            self.client.decode(0, [21], q_ref, output=out_ref)
            by_ref = region.values(out_ref, self.config.q_shape(1), "fp16")
        np.testing.assert_array_equal(by_ref, inline.output)
        want_out, _ = t.reference(q[0].astype(np.float32), k.astype(np.float32),
                                  v.astype(np.float32), 1.0 / np.sqrt(64))
        err = np.linalg.norm(inline.output[0] - want_out) / np.linalg.norm(want_out)
        self.assertLess(err, 2e-3)

    def test_a_tensor_of_another_shape_is_refused_before_it_is_sent(self):
        # Bits of the default shape ([1, 24 -> 8 heads, 128 -> 64]) do not fit this server.
        with self.assertRaises(self.pa.PagedAttnError):
            self.client.decode(0, [11], np.zeros((1, 8, 128), np.uint16))


class Fp8PagesTest(t.ServerCase):
    """Qwen2.5-7B heads (group 7) with fp8 pages: the config says so; decodes of values that
    fp8 holds exactly (multiples of 1/8 up to 2 in magnitude) match the unquantized reference."""
    LAYERS, PAGES = 1, 64
    SERVER_FLAGS = ("--num_qo_heads=28", "--num_kv_heads=4", "--page_size=32",
                    "--kv_cache_dtype=fp8_e4m3")

    def test_exactly_representable_values_decode_as_with_bf16_pages(self):
        self.assertEqual((self.config.dtype, self.config.kv_cache_dtype), ("bf16", "fp8_e4m3"))
        self.client.create(5)
        shape = self.config.kv_shape(70)
        k = np.round(self.rng.uniform(-2, 2, shape) * 8).astype(np.float32) / 8
        v = np.round(self.rng.uniform(-2, 2, shape) * 8).astype(np.float32) / 8
        self.client.append(5, 0, k, v)
        q = t.random_bf16(self.rng, self.config.q_shape(1))
        result = self.client.decode(0, [5], q)
        want_out, want_lse = t.reference(q[0], k, v, 1.0 / np.sqrt(self.config.head_dim))
        t.assert_matches(self, result, (want_out[None], want_lse[None]), "fp8 pages")


if __name__ == "__main__":
    t.main()
