"""pagedattn.LocalChannel against the real pagedattn-server (CPU backend): decodes through a
local channel are bitwise equal to the same decodes as gRPC calls, errors come back with the
Decode RPC's codes and change nothing, pipelined submissions all complete, and a closed
channel unregisters the regions it owns. --unix runs the same tests over a Unix socket.

usage: /usr/bin/python3 local_channel_test.py --server=BIN --package=BUILD/python [--unix]
"""

import os
import unittest

import numpy as np

import package_testing as t

LAYERS, PAGES = 2, 256


class LocalChannelTest(t.ServerCase):
    LAYERS, PAGES = LAYERS, PAGES

    def rand(self, shape):
        return t.random_bf16(self.rng, shape)

    def history(self, first, counts=(7, 40)):
        """Sequences first, first+1 with random histories; each forked to first+100, first+101
        (the same history on other pages). Returns (ids, twins)."""
        ids = [first, first + 1]
        for sid, n in zip(ids, counts):
            self.client.create(sid)
            for layer in range(LAYERS):
                self.client.append(sid, layer, self.rand(self.config.kv_shape(n)),
                                   self.rand(self.config.kv_shape(n)))
        for sid in ids:
            self.client.fork(sid, sid + 100)
        return ids, [sid + 100 for sid in ids]

    def test_local_decodes_are_bitwise_equal_to_grpc(self):
        cfg = self.config
        ids, twins = self.history(10)
        b = len(ids)
        out_bytes = int(np.prod(cfg.q_shape(b))) * 2
        lse_bytes = int(np.prod(cfg.lse_shape(b))) * 4
        with self.pa.SystemRegion(1 << 20, self.client) as region, \
                self.pa.LocalChannel(self.client) as channel:
            for step in range(2):
                for layer in range(LAYERS):
                    q = self.rand(cfg.q_shape(b))
                    k, v = self.rand(cfg.kv_shape(b)), self.rand(cfg.kv_shape(b))
                    if step == 1:
                        k = v = None  # attend only
                    want = self.client.decode(layer, ids, q, k, v)
                    region.reset()
                    out, lse = region.alloc(out_bytes), region.alloc(lse_bytes)
                    got = channel.decode(layer, twins, region.put(q),
                                         region.put(k) if k is not None else None,
                                         region.put(v) if v is not None else None,
                                         output=out, lse=lse)
                    self.assertIsNone(got.output)
                    np.testing.assert_array_equal(region.bf16(out, cfg.q_shape(b)), want.output)
                    np.testing.assert_array_equal(region.float32(lse, cfg.lse_shape(b)), want.lse)
                    self.assertGreater(np.abs(want.output).max(), 0)
            self.assertEqual(channel.in_flight, 0)
        for sid in ids + twins:
            self.client.release(sid)

    def test_errors_have_the_decode_codes_and_change_nothing(self):
        cfg = self.config
        ids, twins = self.history(20)
        before = self.client.stats()
        with self.pa.SystemRegion(1 << 20, self.client) as region, \
                self.pa.LocalChannel(self.client) as channel:
            q = region.put(self.rand(cfg.q_shape(1)))
            out = region.alloc(int(np.prod(cfg.q_shape(1))) * 2)

            def code(**kwargs):
                args = dict(layer=0, sequence_ids=[ids[0]], q=q, output=out)
                args.update(kwargs)
                with self.assertRaises(self.pa.PagedAttnError) as ctx:
                    channel.decode(**args)
                return ctx.exception.code.name

            self.assertEqual(code(layer=LAYERS), "INVALID_ARGUMENT")
            self.assertEqual(code(sequence_ids=[999]), "NOT_FOUND")
            self.assertEqual(code(sequence_ids=[ids[0], ids[0]]), "INVALID_ARGUMENT")
            self.assertEqual(code(sm_scale=float("nan")), "INVALID_ARGUMENT")
            self.assertEqual(code(q=self.pa.TensorRef("nope", 0, q.byte_size)), "NOT_FOUND")
            self.assertEqual(code(output=q), "INVALID_ARGUMENT")          # overlaps q
            self.assertEqual(code(q=self.rand(cfg.q_shape(1))), "INVALID_ARGUMENT")  # inline
            after = self.client.stats()
            self.assertEqual((after.pages_free, after.sequences, after.tokens),
                             (before.pages_free, before.sequences, before.tokens))
            # The channel still works after its errors.
            channel.decode(0, [ids[0]], q, output=out)
        for sid in ids + twins:
            self.client.release(sid)

    def test_pipelined_submissions_all_complete(self):
        cfg = self.config
        ids, twins = self.history(30)
        with self.pa.SystemRegion(1 << 20, self.client) as region, \
                self.pa.LocalChannel(self.client, completion_capacity=2) as channel:
            refs, sent = [], []
            for i in range(6):
                q = region.put(self.rand(cfg.q_shape(1)))
                out = region.alloc(int(np.prod(cfg.q_shape(1))) * 2)
                refs.append((q, out))
                sent.append(channel.submit(0, [ids[i % 2]], q, output=out))
            got = [channel.next(timeout=10) for _ in sent]
            self.assertEqual([r.request_id for r in got], sent)
            for r in got:
                r.check()
            for i, (q, out) in enumerate(refs):
                want = self.client.decode(0, [ids[i % 2]], region.array(q, np.uint16, cfg.q_shape(1)))
                np.testing.assert_array_equal(region.bf16(out, cfg.q_shape(1)), want.output)
        for sid in ids + twins:
            self.client.release(sid)

    def test_closing_unregisters_owned_regions_and_nothing_stays_in_dev_shm(self):
        region = self.pa.SystemRegion(1 << 16, self.client, name="owned-by-channel")
        channel = self.pa.LocalChannel(self.client, owned_regions=["owned-by-channel"])
        path = "/dev/shm/" + channel.shm_name.lstrip("/")
        self.assertFalse(os.path.exists(path))  # unlinked once mapped
        self.assertIn("owned-by-channel", [r.name for r in self.client.list_memory()])
        channel.close()
        channel.close()
        self.assertFalse(os.path.exists(path))
        self.assertNotIn("owned-by-channel", [r.name for r in self.client.list_memory()])
        with self.assertRaises(self.pa.PagedAttnError) as ctx:
            channel.submit(0, [1], region.ref(0, 16), output=region.ref(16, 16))
        self.assertEqual(ctx.exception.code.name, "UNAVAILABLE")
        try:
            region.close()  # already unregistered by the channel
        except self.pa.PagedAttnError as e:
            self.assertEqual(e.code.name, "NOT_FOUND")


if __name__ == "__main__":
    t.main(extra=[("--unix", {"action": "store_true"})])
