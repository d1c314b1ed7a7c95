"""CUDA regions from torch tensors (pagedattn.CudaRegion) against the real pagedattn-server with
the CUDA backend: a torch buffer carved into q/k/v/output/lse gives bitwise the same results as
the inline path, the region's offset accounts for the allocation starting before the tensor's
storage, and the region lists as "cuda" until closed. Skipped (with the reason) without torch,
without a CUDA device, or with a server built without the CUDA backend.

usage: python3 torch_cuda_test.py --server=BIN --package=BUILD/python
"""

import sys
import unittest

import numpy as np

import package_testing as t

LAYERS, PAGES = 2, 256


def _skip_reason():
    try:
        import torch  # pylint: disable=import-outside-toplevel
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


class TorchCudaTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        reason = _skip_reason()
        if reason:
            raise unittest.SkipTest(reason)
        import torch  # pylint: disable=import-outside-toplevel
        import pagedattn  # pylint: disable=import-outside-toplevel
        cls.torch, cls.pa = torch, pagedattn
        cls.server = t.Server(t.ARGS.server, [f"--num_pages={PAGES}", f"--num_layers={LAYERS}",
                                              "--backend=auto"])
        cls.client = pagedattn.Client(cls.server.target)
        cls.client.wait_for_connected(60)
        cls.config = cls.client.config
        if cls.config.backend != "cuda":
            cls.client.close()
            cls.server.kill()
            raise unittest.SkipTest(f"the server runs the {cls.config.backend} backend (built "
                                    "without CUDA?)")

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.kill()

    def setUp(self):
        self.rng = np.random.default_rng(abs(hash(self.id())) % 2**32)

    def rand(self, shape):
        return t.random_bf16(self.rng, shape)

    def carve(self, buf, offset, values=None, dtype=None, shape=None):
        """A tensor of `shape` and `dtype` in buf's bytes at `offset` (16-aligned), filled with
        `values` (float32 numpy holding bf16 values) when given."""
        torch = self.torch
        if values is not None:
            dtype, shape = torch.bfloat16, values.shape
        nbytes = int(np.prod(shape)) * torch.tensor([], dtype=dtype).element_size()
        view = buf[offset:offset + nbytes].view(dtype).view(shape)
        if values is not None:
            view.copy_(torch.from_numpy(values).to(torch.bfloat16))
        return view, offset + (nbytes + 15) // 16 * 16

    def test_refs_into_a_cuda_region_equal_inline(self):
        torch, cfg = self.torch, self.config
        # A small tensor first, so that buf is a piece of the same cudaMalloc segment that
        # starts after it: the region (a whole allocation) starts before buf's storage.
        pad = torch.empty(4096, dtype=torch.uint8, device="cuda")
        buf = torch.zeros(256 * 1024, dtype=torch.uint8, device="cuda")
        b = 2
        ids = [10, 11]
        for sid in ids:
            self.client.create(sid)
        for sid in ids:
            self.client.create(sid + 100)
        with self.pa.CudaRegion(buf, self.client) as region:
            self.assertGreater(region.offset_of(buf), 0,
                               "buf starts its allocation: the caching allocator did not "
                               "sub-allocate (PYTORCH_NO_CUDA_MEMORY_CACHING?)")
            listed = {r.name: r for r in self.client.list_memory()}
            self.assertEqual(listed[region.name].kind, "cuda")
            self.assertEqual(listed[region.name].device_id, buf.device.index)
            self.assertEqual(listed[region.name].byte_size, region.byte_size)
            # History: inline into 10, 11; by reference (k, v in the region) into 110, 111.
            for layer in range(LAYERS):
                for sid in ids:
                    k, v = self.rand(cfg.kv_shape(7)), self.rand(cfg.kv_shape(7))
                    self.client.append(sid, layer, k, v)
                    k_t, off = self.carve(buf, 0, k)
                    v_t, _ = self.carve(buf, off, v)
                    torch.cuda.synchronize()
                    self.client.append(sid + 100, layer, region.ref(k_t), region.ref(v_t))
            for mode in ("inputs", "outputs", "all"):
                for layer in range(LAYERS):
                    q, k, v = (self.rand(cfg.q_shape(b)), self.rand(cfg.kv_shape(b)),
                               self.rand(cfg.kv_shape(b)))
                    want = self.client.decode(layer, ids, q, k, v)
                    off = 0
                    q_t, off = self.carve(buf, off, q)
                    k_t, off = self.carve(buf, off, k)
                    v_t, off = self.carve(buf, off, v)
                    out_t, off = self.carve(buf, off, dtype=torch.bfloat16,
                                            shape=cfg.q_shape(b))
                    lse_t, off = self.carve(buf, off, dtype=torch.float32,
                                            shape=cfg.lse_shape(b))
                    torch.cuda.synchronize()
                    inputs = ([region.ref(x) for x in (q_t, k_t, v_t)]
                              if mode != "outputs" else [q, k, v])
                    outputs = ({"output": region.ref(out_t), "lse": region.ref(lse_t)}
                               if mode != "inputs" else {})
                    got = self.client.decode(layer, [i + 100 for i in ids], *inputs, **outputs)
                    if outputs:
                        self.assertIsNone(got.output)
                        got_out = out_t.float().cpu().numpy()
                        got_lse = lse_t.cpu().numpy()
                    else:
                        got_out, got_lse = got.output, got.lse
                    np.testing.assert_array_equal(got_out, want.output, f"{mode} {layer}")
                    np.testing.assert_array_equal(got_lse, want.lse, f"{mode} {layer}")
                    self.assertGreater(np.abs(got_out).max(), 0)
        self.assertNotIn(region.name, [r.name for r in self.client.list_memory()])
        for sid in ids:
            self.client.release(sid)
            self.client.release(sid + 100)
        del pad

    def test_bad_cuda_refs_and_handles(self):
        torch = self.torch
        buf = torch.zeros(64 * 1024, dtype=torch.uint8, device="cuda")
        with self.pa.CudaRegion(buf, self.client) as region:
            with self.assertRaises(self.pa.PagedAttnError) as ctx:  # unaligned
                region.ref(buf[8:8 + 32])
            self.assertEqual(ctx.exception.code.name, "INVALID_ARGUMENT")
            q_bytes = int(np.prod(self.config.q_shape(1))) * 2
            self.client.create(50)
            outside = self.pa.TensorRef(region.name, region.byte_size - 16, q_bytes)
            with self.assertRaises(self.pa.PagedAttnError) as ctx:
                self.client.decode(0, [50], outside)
            self.assertEqual(ctx.exception.code.name, "INVALID_ARGUMENT")
            self.client.release(50)
        # A handle that names no allocation.
        with self.assertRaises(self.pa.PagedAttnError) as ctx:
            self.client.register_cuda_memory("bogus", bytes(64), 0, 4096)
        self.assertEqual(ctx.exception.code.name, "FAILED_PRECONDITION")
        self.assertEqual(self.client.list_memory(), [])


if __name__ == "__main__":
    # Without torch and a CUDA device nothing here can run: exit 77, which ctest reports as
    # Skipped (SKIP_RETURN_CODE), instead of a pass.
    if _skip_reason():
        print("skipped:", _skip_reason())
        sys.exit(77)
    t.main()
