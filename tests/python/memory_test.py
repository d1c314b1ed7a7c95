"""Tensors by reference from Python against the real pagedattn-server (CPU backend): system
regions (SystemRegion) give bitwise the same results as inline tensors, every bad reference or
registration gets its specific status and changes nothing, unregistering waits for queued work,
and ListMemory shows what is registered. --unix runs the same tests over a Unix socket.

usage: /usr/bin/python3 memory_test.py --server=BIN --package=BUILD/python [--unix]
"""

import asyncio
import os
import threading
import unittest

import numpy as np

import package_testing as t

LAYERS, PAGES = 2, 512


class MemoryTest(t.ServerCase):
    LAYERS, PAGES = LAYERS, PAGES

    def setUp(self):
        super().setUp()
        self.regions_before = self.client.list_memory()

    def tearDown(self):
        self.assertEqual(self.client.list_memory(), self.regions_before, "a region leaked")

    # -- helpers ------------------------------------------------------------------------------
    def rand(self, shape):
        return t.random_bf16(self.rng, shape)

    def code_of(self, fn, *args, **kwargs):
        with self.assertRaises(self.pa.PagedAttnError) as ctx:
            fn(*args, **kwargs)
        return ctx.exception.code.name

    def state(self):
        """Everything a failed call must leave as it was."""
        s = self.client.stats()
        return (s.pages_free, s.sequences, s.tokens, self.client.list_memory())

    def two_sequences(self, first, n=(5, 9)):
        """Creates sequences first, first+1 with the same random history in the inline path
        and nowhere else; returns their ids."""
        ids = [first, first + 1]
        for sid, count in zip(ids, n):
            self.client.create(sid)
            for layer in range(LAYERS):
                self.client.append(sid, layer, self.rand(self.config.kv_shape(count)),
                                   self.rand(self.config.kv_shape(count)))
        return ids

    def release(self, *ids):
        for sid in ids:
            self.client.release(sid)

    # -- equality with the inline path --------------------------------------------------------
    def test_refs_are_bitwise_equal_to_inline(self):
        """Two forks of the same history take the same steps, one inline and one by reference
        (q, k, v; output, lse; and mixed): every output and lse is bit for bit the same."""
        cfg = self.config
        base = self.two_sequences(100)
        self.client.fork(100, 200)
        self.client.fork(101, 201)
        inline_ids, ref_ids = base, [200, 201]
        b = 2
        with self.pa.SystemRegion(1 << 20, self.client) as region:
            out_bytes = int(np.prod(cfg.q_shape(b))) * 2
            lse_bytes = int(np.prod(cfg.lse_shape(b))) * 4
            modes = ["inputs", "outputs", "all", "mixed", "attend"]
            for mode, layer in ((m, layer) for m in modes for layer in range(LAYERS)):
                q = self.rand(cfg.q_shape(b))
                k = v = None
                if mode != "attend":
                    k, v = self.rand(cfg.kv_shape(b)), self.rand(cfg.kv_shape(b))
                want = self.client.decode(layer, inline_ids, q, k, v)
                region.reset()
                args = {"q": q, "k": k, "v": v}
                if mode in ("inputs", "all", "attend"):
                    args = {name: (region.put(x) if x is not None else None)
                            for name, x in args.items()}
                elif mode == "mixed":
                    args = {"q": region.put(q), "k": k, "v": region.put(v)}
                out = lse = None
                if mode in ("outputs", "all", "mixed"):
                    out, lse = region.alloc(out_bytes), region.alloc(lse_bytes)
                got = self.client.decode(layer, ref_ids, args["q"], args["k"], args["v"],
                                         output=out, lse=lse)
                if out is None:
                    got_out, got_lse = got.output, got.lse
                else:
                    self.assertIsNone(got.output)
                    self.assertIsNone(got.lse)
                    got_out = region.bf16(out, cfg.q_shape(b))
                    got_lse = region.float32(lse, cfg.lse_shape(b))
                np.testing.assert_array_equal(got_out, want.output, f"{mode} at layer {layer}")
                np.testing.assert_array_equal(got_lse, want.lse, f"{mode} at layer {layer}")
                self.assertGreater(np.abs(got_out).max(), 0)  # real data came back
        self.release(*inline_ids, *ref_ids)

    def test_append_by_reference_equals_inline(self):
        cfg = self.config
        n = cfg.page_size + 3
        self.client.create(300)
        self.client.create(301)
        with self.pa.SystemRegion(1 << 20, self.client) as region:
            for layer in range(LAYERS):
                k, v = self.rand(cfg.kv_shape(n)), self.rand(cfg.kv_shape(n))
                self.client.append(300, layer, k, v)
                region.reset()
                if layer == 0:
                    length = self.client.append(301, layer, region.put(k), region.put(v))
                else:  # one inline, one by reference
                    length = self.client.append(301, layer, k, region.put(v))
            self.assertEqual(length, n)
            q = self.rand(cfg.q_shape(1))
            for layer in range(LAYERS):
                a = self.client.decode(layer, [300], q)
                r = self.client.decode(layer, [301], q)
                np.testing.assert_array_equal(a.output, r.output)
                np.testing.assert_array_equal(a.lse, r.lse)
        self.release(300, 301)

    def test_stream_and_async_take_refs(self):
        cfg = self.config
        ids = self.two_sequences(400)
        q = self.rand(cfg.q_shape(2))
        want = self.client.decode(0, ids, q)
        with self.pa.SystemRegion(1 << 16, self.client) as region:
            q_ref = region.put(q)
            out = region.alloc(int(np.prod(cfg.q_shape(2))) * 2)
            calls = [self.pa.DecodeCall(0, ids, q_ref, output=out) for _ in range(4)]
            for result in self.client.decode_stream(calls):
                result.check()
                self.assertIsNone(result.output)
                np.testing.assert_array_equal(result.lse, want.lse)
            np.testing.assert_array_equal(region.bf16(out, cfg.q_shape(2)), want.output)

            async def run():
                async with self.pa.AsyncClient(self.server.target) as aclient:
                    results = await asyncio.gather(
                        *[aclient.decode(0, ids, q_ref) for _ in range(4)])
                    async with await aclient.open_decode_stream() as stream:
                        results.append(await stream.decode(0, ids, q_ref))
                    names = [r.name for r in await aclient.list_memory()]
                    return results, names
            results, names = asyncio.run(run())
            self.assertIn(region.name, names)
            for result in results:
                np.testing.assert_array_equal(result.output, want.output)
        self.release(*ids)

    def test_async_region_helpers(self):
        async def run():
            async with self.pa.AsyncClient(self.server.target) as aclient:
                region = self.pa.SystemRegion(4096)
                await region.register_async(aclient, "async-region")
                listed = await aclient.list_memory()
                await region.aclose()
                return listed, await aclient.list_memory()
        listed, after = asyncio.run(run())
        self.assertIn(self.pa.MemoryRegion("async-region", "system", 4096, -1), listed)
        self.assertEqual(after, self.regions_before)

    def test_the_readme_example(self):
        """client/python/README.md's "Tensors by reference" example, run as written."""
        readme = os.path.join(t.HERE, "..", "..", "client", "python", "README.md")
        with open(readme) as f:
            blocks = f.read().split("```python\n")[1:]
        [example] = [b.split("```")[0] for b in blocks if "SystemRegion(" in b]
        target = self.server.target
        self.assertIn('"127.0.0.1:50051"', example)
        before = self.client.stats()
        exec(compile(example.replace("127.0.0.1:50051", target), "README example", "exec"),
             {})  # pylint: disable=exec-used
        after = self.client.stats()
        self.assertEqual((after.sequences, after.pages_free),
                         (before.sequences, before.pages_free))
        self.assertGreater(after.decoded_sequences, before.decoded_sequences)

    # -- registration and listing -------------------------------------------------------------
    def test_list_memory_and_region_lifetime(self):
        with self.pa.SystemRegion(4096 + 16, self.client, name="lm-b") as b, \
                self.pa.SystemRegion(8192, self.client, name="lm-a") as a:
            listed = [r for r in self.client.list_memory() if r.name.startswith("lm-")]
            self.assertEqual(listed, [self.pa.MemoryRegion("lm-a", "system", 8192, -1),
                                      self.pa.MemoryRegion("lm-b", "system", 4096 + 16, -1)])
            self.assertTrue(os.path.exists("/dev/shm" + a.key))
            self.assertEqual(os.stat("/dev/shm" + a.key).st_mode & 0o777, 0o600)
            # A part of an object under a second name: offset 16 of b.
            self.client.register_system_memory("lm-part", b.key, 16, 4096)
            self.client.unregister_memory("lm-part")
        self.assertFalse(os.path.exists("/dev/shm" + a.key))
        self.assertFalse(os.path.exists("/dev/shm" + b.key))

    def test_registered_region_outlives_unlink(self):
        """The server's mapping stays valid after the object's name is gone."""
        cfg = self.config
        ids = self.two_sequences(500)
        q = self.rand(cfg.q_shape(2))
        want = self.client.decode(1, ids, q)
        with self.pa.SystemRegion(1 << 16, self.client) as region:
            q_ref = region.put(q)
            region.unlink()
            got = self.client.decode(1, ids, q_ref)
            np.testing.assert_array_equal(got.output, want.output)
        self.release(*ids)

    # -- errors: the most specific status, nothing changed ------------------------------------
    def test_registration_errors_change_nothing(self):
        with self.pa.SystemRegion(4096, self.client, name="reg-err") as region:
            before = self.state()
            cases = {
                "ALREADY_EXISTS": ("reg-err", region.key, 0, 4096),
                "INVALID_ARGUMENT": ("reg-err2", region.key, 8, 1024),       # unaligned offset
                "FAILED_PRECONDITION": ("reg-err3", "/pa-py-no-such-object", 0, 16),
            }
            for code, args in cases.items():
                self.assertEqual(self.code_of(self.client.register_system_memory, *args), code,
                                 args)
            # Past the end of the object, a zero size, a malformed key, a bad name.
            self.assertEqual(self.code_of(self.client.register_system_memory, "reg-big",
                                          region.key, 0, 8192), "FAILED_PRECONDITION")
            for args in [("reg-0", region.key, 0, 0), ("reg-k", "no-slash", 0, 16),
                         ("bad name", region.key, 0, 16), ("", region.key, 0, 16)]:
                self.assertEqual(self.code_of(self.client.register_system_memory, *args),
                                 "INVALID_ARGUMENT", args)
            # A cuda region on the CPU backend.
            self.assertEqual(self.code_of(self.client.register_cuda_memory, "reg-cuda",
                                          os.urandom(64), 0, 4096), "FAILED_PRECONDITION")
            self.assertEqual(self.code_of(self.client.register_cuda_memory, "reg-cuda",
                                          os.urandom(63), 0, 4096), "INVALID_ARGUMENT")
            self.assertEqual(self.state(), before)
        self.assertEqual(self.code_of(self.client.unregister_memory, "reg-err"), "NOT_FOUND")

    def test_more_regions_than_the_limit(self):
        """The server's default --max_memory_regions is 256 (the server has no flag for it):
        the 257th registration is RESOURCE_EXHAUSTED and changes nothing."""
        limit = 256
        with self.pa.SystemRegion(4096) as shm:
            free = limit - len(self.client.list_memory())
            names = [f"lim-{i:03d}" for i in range(free)]
            try:
                for name in names:
                    self.client.register_system_memory(name, shm.key, 0, 4096)
                before = self.state()
                self.assertEqual(len(before[3]), limit)
                self.assertEqual(self.code_of(self.client.register_system_memory, "lim-over",
                                              shm.key, 0, 4096), "RESOURCE_EXHAUSTED")
                self.assertEqual(self.state(), before)
            finally:
                for name in names:
                    self.client.unregister_memory(name)

    def test_bad_refs_change_nothing(self):
        cfg = self.config
        ids = self.two_sequences(600)
        b = 2
        q_bytes = int(np.prod(cfg.q_shape(b))) * 2
        kv_bytes = int(np.prod(cfg.kv_shape(b))) * 2
        lse_bytes = int(np.prod(cfg.lse_shape(b))) * 4
        TR = self.pa.TensorRef
        with self.pa.SystemRegion(1 << 16, self.client, name="bad-refs") as region:
            q, k, v = (self.rand(cfg.q_shape(b)), self.rand(cfg.kv_shape(b)),
                       self.rand(cfg.kv_shape(b)))
            q_ref, k_ref, v_ref = region.put(q), region.put(k), region.put(v)
            out, lse = region.alloc(q_bytes), region.alloc(lse_bytes)
            sentinel = self.rng.standard_normal(q_bytes // 4).astype(np.float32)
            region.array(out, np.float32, (q_bytes // 4,))[...] = sentinel
            lse_sentinel = self.rng.standard_normal(cfg.lse_shape(b)).astype(np.float32)
            region.array(lse, np.float32, cfg.lse_shape(b))[...] = lse_sentinel
            before = self.state()
            cases = [
                ("NOT_FOUND", dict(q=TR("no-such-region", 0, q_bytes), output=out, lse=lse)),
                ("INVALID_ARGUMENT", dict(q=TR("bad-refs", region.size - 16, q_bytes))),  # outside
                ("INVALID_ARGUMENT", dict(q=TR("bad-refs", 0, q_bytes - 2))),    # wrong size
                ("INVALID_ARGUMENT", dict(q=TR("bad-refs", 8, q_bytes))),        # unaligned
                ("INVALID_ARGUMENT", dict(q=q_ref, k=k_ref, v=v_ref,
                                          output=TR("bad-refs", k_ref.offset, q_bytes))),
                ("INVALID_ARGUMENT", dict(q=q_ref, lse=TR("bad-refs", q_ref.offset,
                                                          lse_bytes))),  # overlaps q
                ("INVALID_ARGUMENT", dict(q=q_ref, output=out,
                                          lse=TR("bad-refs", out.offset, lse_bytes))),
                ("NOT_FOUND", dict(q=q_ref, k=k_ref, v=TR("gone", 0, kv_bytes), output=out,
                                   lse=lse)),
                ("INVALID_ARGUMENT", dict(q=q_ref, k=k_ref, v=TR("bad-refs", v_ref.offset,
                                                                 kv_bytes + 16))),
            ]
            for code, args in cases:
                call = dict(q=None, k=None, v=None, output=None, lse=None)
                call.update(args)
                self.assertEqual(self.code_of(self.client.decode, 1, ids, call["q"], call["k"],
                                              call["v"], output=call["output"],
                                              lse=call["lse"]), code, args)
            # Both inline and by reference: the client cannot build that, so send the message.
            request = self.pa._protocol.decode_request(  # pylint: disable=protected-access
                cfg, self.pa.DecodeCall(1, ids, q), 1)
            request.q_ref.CopyFrom(q_ref.to_message())
            with self.assertRaises(Exception) as ctx:
                self.client._stub.Decode(request)  # pylint: disable=protected-access
            self.assertEqual(ctx.exception.code().name, "INVALID_ARGUMENT")
            # AppendKV: wrong size, unknown region, both ways.
            self.assertEqual(self.code_of(self.client.append, 600, 0, TR("bad-refs", 0, 48),
                                          k_ref, num_tokens=b), "INVALID_ARGUMENT")
            self.assertEqual(self.code_of(self.client.append, 600, 0, k_ref,
                                          TR("nope", 0, kv_bytes)), "NOT_FOUND")
            request = self.pa._protocol.append_request(  # pylint: disable=protected-access
                cfg, 600, 0, k, v)
            request.k_ref.CopyFrom(k_ref.to_message())
            with self.assertRaises(Exception) as ctx:
                self.client._stub.AppendKV(request)  # pylint: disable=protected-access
            self.assertEqual(ctx.exception.code().name, "INVALID_ARGUMENT")
            self.assertEqual(self.state(), before)
            # The output stayed untouched by every refused call.
            np.testing.assert_array_equal(region.array(out, np.float32, (q_bytes // 4,)),
                                          sentinel)
            np.testing.assert_array_equal(region.float32(lse, cfg.lse_shape(b)), lse_sentinel)
            # And the sequences still decode exactly as before.
            want = self.client.decode(1, ids, q)
            np.testing.assert_array_equal(self.client.decode(1, ids, q_ref).output, want.output)
        self.release(*ids)

    def test_client_side_checks(self):
        with self.pa.SystemRegion(4096, self.client) as region:
            for args in [(8, 16), (0, 4097), (4096, 16), (0, 0)]:
                self.assertEqual(self.code_of(region.ref, *args), "INVALID_ARGUMENT", args)
            self.assertEqual(self.code_of(region.alloc, 4097), "RESOURCE_EXHAUSTED")
            # An output must be a TensorRef.
            q = self.rand(self.config.q_shape(1))
            self.assertEqual(self.code_of(self.client.decode, 0, [1], q, output=q),
                             "INVALID_ARGUMENT")
        unregistered = self.pa.SystemRegion(4096)
        try:
            self.assertEqual(self.code_of(unregistered.ref, 0, 16), "FAILED_PRECONDITION")
        finally:
            unregistered.close()
        self.assertEqual(self.code_of(self.pa.CudaRegion, np.zeros(4)), "INVALID_ARGUMENT")
        # A registration that fails leaves no shared-memory object behind.
        mine = lambda: {n for n in os.listdir("/dev/shm") if n.startswith(f"pa-py-{os.getpid()}-")}
        shm_before = mine()
        self.assertEqual(self.code_of(self.pa.SystemRegion, 4096, self.client, name="bad name"),
                         "INVALID_ARGUMENT")
        self.assertEqual(mine(), shm_before)

    # -- unregister waits for queued work -----------------------------------------------------
    def test_unregister_waits_for_queued_work(self):
        """Many referenced decodes in flight on a stream; UnregisterMemory issued meanwhile
        returns only after every one that was accepted has finished, and the ones the server
        took before the unregister all succeed with the right output."""
        cfg = self.config
        ids = self.two_sequences(700, n=(1500, 2500))
        q = self.rand(cfg.q_shape(2))
        want = self.client.decode(0, ids, q)
        region = self.pa.SystemRegion(1 << 16, self.client, name="busy")
        q_ref = region.put(q)
        count = 300
        results = []
        first = threading.Event()

        def reader():
            calls = (self.pa.DecodeCall(0, ids, q_ref) for _ in range(count))
            for result in self.client.decode_stream(calls):
                results.append(result)
                first.set()

        thread = threading.Thread(target=reader)
        thread.start()
        self.assertTrue(first.wait(30))
        queued = 0
        while queued == 0 and thread.is_alive():
            queued = self.client.stats().queue_depth
        self.assertGreater(queued, 0, "no work was queued")
        self.client.unregister_memory("busy")
        # Work that still read q after this point would see other values.
        region.array(q_ref, np.uint16, cfg.q_shape(2))[...] = self.pa.bf16.to_bits(-q)
        self.assertNotIn("busy", [r.name for r in self.client.list_memory()])
        thread.join(60)
        self.assertFalse(thread.is_alive())
        region._forget()  # pylint: disable=protected-access
        region.close()
        ok = [r for r in results if r.error is None]
        self.assertEqual(len(results), count)
        self.assertGreater(len(ok), 0)
        # Each decode that resolved the region before it was unlisted finished before the
        # unregister returned: all of them saw the original q.
        for r in ok:
            np.testing.assert_array_equal(r.output, want.output)
            np.testing.assert_array_equal(r.lse, want.lse)
        # The later ones name an unlisted region: NOT_FOUND, all after the last OK.
        self.assertEqual(results[:len(ok)], ok)
        self.assertTrue(all(r.error.code.name == "NOT_FOUND" for r in results[len(ok):]))
        self.release(*ids)


if __name__ == "__main__":
    t.main(extra=[("--unix", {"action": "store_true"})])
