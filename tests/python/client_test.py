"""The synchronous pagedattn.Client against the real pagedattn-server: config, create, append,
decode (unary and streaming), fork, release, stats and health, every result checked against a
numpy reference of the attention.

usage: /usr/bin/python3 client_test.py --server=BIN --package=BUILD/python
"""

import threading
import unittest

import numpy as np

import package_testing as t

LAYERS, PAGES = 2, 32


class ClientTest(t.ServerCase):
    LAYERS, PAGES = LAYERS, PAGES

    def setUp(self):
        super().setUp()
        self.mirror = t.Mirror(self.config)

    def create(self, sid):
        self.client.create(sid)
        self.mirror.create(sid)

    def append(self, sid, layer, n):
        k = t.random_bf16(self.rng, self.config.kv_shape(n))
        v = t.random_bf16(self.rng, self.config.kv_shape(n))
        length = self.client.append(sid, layer, k, v)
        self.mirror.append(sid, layer, k, v)
        self.assertEqual(length, self.mirror.length(sid))

    def step(self, layer, sids, sm_scale=0.0):
        """A decode step (new k/v) at one layer, checked."""
        b = len(sids)
        q = t.random_bf16(self.rng, self.config.q_shape(b))
        k = t.random_bf16(self.rng, self.config.kv_shape(b))
        v = t.random_bf16(self.rng, self.config.kv_shape(b))
        result = self.client.decode(layer, sids, q, k, v, sm_scale=sm_scale)
        for i, sid in enumerate(sids):
            self.mirror.append(sid, layer, k[i:i + 1], v[i:i + 1])
        t.assert_matches(self, result, self.mirror.expected(layer, sids, q, True, sm_scale),
                         f"step at layer {layer}")

    def attend(self, layer, sids, sm_scale=0.0):
        q = t.random_bf16(self.rng, self.config.q_shape(len(sids)))
        result = self.client.decode(layer, sids, q, sm_scale=sm_scale)
        t.assert_matches(self, result, self.mirror.expected(layer, sids, q, False, sm_scale),
                         f"attend at layer {layer}")

    def test_config_comes_from_the_server(self):
        c = self.config
        self.assertEqual((c.num_layers, c.num_pages, c.backend), (LAYERS, PAGES, "cpu"))
        self.assertGreater(c.num_qo_heads, 0)
        self.assertEqual(c.num_qo_heads % c.num_kv_heads, 0)
        self.assertGreater(c.head_dim, 0)
        self.assertGreater(c.page_size, 0)
        self.assertGreaterEqual(c.max_batch_size, 2)
        self.assertEqual(c.max_message_bytes, self.client.options.max_message_bytes)
        self.assertEqual(self.client.model_config(refresh=True), c)

    def test_health(self):
        self.assertEqual(self.client.health(), "SERVING")
        self.assertEqual(self.client.health("pagedattn.v1.PagedAttention"), "SERVING")
        with self.assertRaises(self.pa.PagedAttnError) as ctx:
            self.client.health("no.such.Service")
        self.assertEqual(ctx.exception.code.name, "NOT_FOUND")

    def test_create_append_decode_fork_release(self):
        page = self.config.page_size
        before = self.client.stats()
        self.create(11)
        self.create(12)
        for layer in range(LAYERS):
            self.append(11, layer, page + 1)
            self.append(12, layer, 3)
        for layer in range(LAYERS):
            self.step(layer, [11, 12])
        self.attend(0, [12, 11], sm_scale=0.2)
        s = self.client.stats()
        self.assertEqual(s.sequences - before.sequences, 2)
        self.assertEqual(s.tokens - before.tokens, page + 2 + 4)
        self.assertEqual(before.pages_free - s.pages_free, 3)
        # The child reads the parent's tokens; its first step copies the shared last page.
        self.client.fork(12, 13)
        self.mirror.fork(12, 13)
        self.assertEqual(self.client.stats().pages_free, s.pages_free)
        for layer in range(LAYERS):
            self.step(layer, [13])
        self.assertEqual(self.client.stats().pages_free, s.pages_free - 1)
        self.attend(LAYERS - 1, [12, 13])
        for sid in (11, 12, 13):
            self.client.release(sid)
        s = self.client.stats()
        self.assertEqual((s.pages_free, s.sequences, s.tokens),
                         (before.pages_free, before.sequences, before.tokens))

    def test_bf16_bits_and_float_inputs_are_the_same_request(self):
        self.create(41)
        n = 5
        k = t.random_bf16(self.rng, self.config.kv_shape(n))
        v = t.random_bf16(self.rng, self.config.kv_shape(n))
        # Layer 0 as bf16 bit patterns, the last layer as float64: the same values arrive.
        self.client.append(41, 0, self.pa.bf16.to_bits(k), self.pa.bf16.to_bits(v))
        for layer in range(1, LAYERS):
            self.client.append(41, layer, k.astype(np.float64), v.astype(np.float64))
        for layer in range(LAYERS):
            self.mirror.append(41, layer, k, v)
        q = t.random_bf16(self.rng, self.config.q_shape(1))
        for layer in range(LAYERS):
            want = self.mirror.expected(layer, [41], q, False)
            got_bits = self.client.decode(layer, [41], self.pa.bf16.to_bits(q))
            got_f16 = self.client.decode(layer, [41], q.astype(np.float16))
            t.assert_matches(self, got_bits, want)
            t.assert_matches(self, got_f16, want)
        self.client.release(41)

    def test_decode_stream_keeps_order_and_reports_each_error(self):
        self.create(21)
        for layer in range(LAYERS):
            self.append(21, layer, 20)
        calls, qs = [], []
        for i in range(12):
            q = t.random_bf16(self.rng, self.config.q_shape(1))
            calls.append(self.pa.DecodeCall(layer=i % LAYERS, sequence_ids=[21], q=q,
                                                   request_id=100 + i))
            qs.append(q)
        unknown = self.pa.DecodeCall(layer=0, sequence_ids=[404], q=qs[0], request_id=999)
        stream = calls[:6] + [unknown] + calls[6:]
        results = list(self.client.decode_stream(iter(stream)))
        self.assertEqual([r.request_id for r in results], [c.request_id for c in stream])
        self.assertEqual(results[6].error.code.name, "NOT_FOUND")
        self.assertIsNone(results[6].output)
        with self.assertRaises(self.pa.PagedAttnError):
            results[6].check()
        for call, q, result in zip(calls, qs, results[:6] + results[7:]):
            self.assertIsNone(result.error)
            t.assert_matches(self, result, self.mirror.expected(call.layer, [21], q, False),
                             f"request {call.request_id}")
        self.client.release(21)

    def test_threads_share_one_client(self):
        """Four threads, each stepping its own sequence through every layer, on one Client."""
        sids = [71, 72, 73, 74]
        for sid in sids:
            self.create(sid)
            for layer in range(LAYERS):
                self.append(sid, layer, 10 + sid)
        errors = []

        def worker(sid, seed):
            rng = np.random.default_rng(seed)
            try:
                for _ in range(3):
                    for layer in range(LAYERS):
                        q = t.random_bf16(rng, self.config.q_shape(1))
                        k = t.random_bf16(rng, self.config.kv_shape(1))
                        v = t.random_bf16(rng, self.config.kv_shape(1))
                        result = self.client.decode(layer, [sid], q, k, v)
                        self.mirror.append(sid, layer, k, v)  # this thread's own entry
                        t.assert_matches(self, result,
                                         self.mirror.expected(layer, [sid], q, True))
            except Exception as e:  # pylint: disable=broad-except
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(sid, sid)) for sid in sids]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        self.assertEqual(errors, [])
        for sid in sids:
            self.assertEqual(self.mirror.length(sid), 10 + sid + 3)
            self.attend(LAYERS - 1, [sid])
            self.client.release(sid)

    def test_decode_stream_ends_at_a_bad_call_after_answering_the_ones_before(self):
        self.create(61)
        for layer in range(LAYERS):
            self.append(61, layer, 3)
        q = t.random_bf16(self.rng, self.config.q_shape(1))
        call = self.pa.DecodeCall
        calls = [call(0, [61], q), call(0, [61], q), call(0, [61], q[:, :-1]), call(0, [61], q)]
        results = []
        with self.assertRaises(self.pa.PagedAttnError) as ctx:
            for result in self.client.decode_stream(calls):
                results.append(result)
        self.assertEqual(ctx.exception.code.name, "INVALID_ARGUMENT")
        self.assertEqual(len(results), 2)
        for result in results:
            t.assert_matches(self, result.check(), self.mirror.expected(0, [61], q, False))
        self.client.release(61)

    def test_decode_stream_steps_through_layers_in_order(self):
        """A decode step's layers on one stream: applied in the order sent."""
        self.create(51)
        for layer in range(LAYERS):
            self.append(51, layer, 7)
        b = 1
        calls, rows = [], []
        for step in range(3):
            for layer in range(LAYERS):
                q = t.random_bf16(self.rng, self.config.q_shape(b))
                k = t.random_bf16(self.rng, self.config.kv_shape(b))
                v = t.random_bf16(self.rng, self.config.kv_shape(b))
                calls.append(self.pa.DecodeCall(layer, [51], q, k, v))
                rows.append((layer, q, k, v))
        results = list(self.client.decode_stream(calls))
        self.assertEqual(len(results), len(calls))
        for (layer, q, k, v), result in zip(rows, results):
            self.mirror.append(51, layer, k, v)
            t.assert_matches(self, result.check(), self.mirror.expected(layer, [51], q, True))
        self.assertEqual(self.mirror.length(51), 7 + 3)
        self.attend(LAYERS - 1, [51])
        self.client.release(51)


if __name__ == "__main__":
    t.main()
