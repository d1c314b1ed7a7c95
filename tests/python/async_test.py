"""pagedattn.AsyncClient against the real pagedattn-server: micro-batches pipelined over the
layers with concurrent unary decodes, a decode step's layers pipelined on one
AsyncDecodeStream, and per-request errors on a stream; every result checked against a numpy
reference.

usage: /usr/bin/python3 async_test.py --server=BIN --package=BUILD/python
"""

import asyncio
import unittest

import numpy as np

import package_testing as t

LAYERS, PAGES = 3, 64


class AsyncClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import pagedattn  # pylint: disable=import-outside-toplevel
        cls.pagedattn = pagedattn
        cls.server = t.Server(t.ARGS.server, [f"--num_pages={PAGES}", f"--num_layers={LAYERS}",
                                              "--cpu_threads=2"])

    @classmethod
    def tearDownClass(cls):
        cls.server.kill()

    def setUp(self):
        self.rng = np.random.default_rng(abs(hash(self.id())) % 2**32)

    def run_async(self, body):
        async def main():
            async with self.pagedattn.AsyncClient(self.server.target) as client:
                await client.wait_for_connected(20)
                self.config = await client.model_config()
                self.mirror = t.Mirror(self.config)
                await body(client)
        asyncio.run(main())

    def tensors(self, b):
        c = self.config
        return (t.random_bf16(self.rng, c.q_shape(b)), t.random_bf16(self.rng, c.kv_shape(b)),
                t.random_bf16(self.rng, c.kv_shape(b)))

    async def prefill(self, client, sid, n):
        await client.create(sid)
        self.mirror.create(sid)
        for layer in range(LAYERS):
            k = t.random_bf16(self.rng, self.config.kv_shape(n))
            v = t.random_bf16(self.rng, self.config.kv_shape(n))
            length = await client.append(sid, layer, k, v)
            self.mirror.append(sid, layer, k, v)
            self.assertEqual(length, self.mirror.length(sid))

    def test_micro_batches_pipelined_over_layers(self):
        """Four micro-batches, each walking its steps layer by layer, all in flight at once."""
        async def body(client):
            batches = [[100 + 10 * m + i for i in range(2)] for m in range(4)]
            for m, ids in enumerate(batches):
                for i, sid in enumerate(ids):
                    await self.prefill(client, sid, 5 + 31 * m + i)
            before = await client.stats()
            steps = 3

            async def run(ids):
                for _ in range(steps):
                    for layer in range(LAYERS):
                        q, k, v = self.tensors(len(ids))
                        result = await client.decode(layer, ids, q, k, v)
                        for i, sid in enumerate(ids):
                            self.mirror.append(sid, layer, k[i:i + 1], v[i:i + 1])
                        t.assert_matches(self, result, self.mirror.expected(layer, ids, q, True),
                                         f"{ids} layer {layer}")

            await asyncio.gather(*(run(ids) for ids in batches))
            after = await client.stats()
            self.assertEqual(after.tokens - before.tokens, steps * 8)
            self.assertEqual(after.decoded_sequences - before.decoded_sequences,
                             steps * LAYERS * 8)
            for ids in batches:
                q = self.tensors(len(ids))[0]
                result = await client.decode(LAYERS - 1, ids, q)
                t.assert_matches(self, result, self.mirror.expected(LAYERS - 1, ids, q, False))
                for sid in ids:
                    await client.release(sid)
        self.run_async(body)

    def test_layers_pipelined_on_one_stream(self):
        """Every layer of several decode steps in flight at once on one stream: the stream
        applies them in the order written, so each step sees its previous layers."""
        async def body(client):
            ids = [7, 8, 9]
            for i, sid in enumerate(ids):
                await self.prefill(client, sid, 3 + 40 * i)
            calls = []
            for _ in range(2):
                for layer in range(LAYERS):
                    calls.append((layer,) + self.tensors(len(ids)))
            async with await client.open_decode_stream() as stream:
                results = await asyncio.gather(
                    *(stream.decode(layer, ids, q, k, v) for layer, q, k, v in calls))
            for (layer, q, k, v), result in zip(calls, results):
                for i, sid in enumerate(ids):
                    self.mirror.append(sid, layer, k[i:i + 1], v[i:i + 1])
                t.assert_matches(self, result, self.mirror.expected(layer, ids, q, True),
                                 f"layer {layer}")
            stats = await client.stats()
            self.assertEqual(stats.tokens, sum(self.mirror.length(s) for s in ids))
            for sid in ids:
                await client.release(sid)
        self.run_async(body)

    def test_stream_request_error_fails_only_that_request(self):
        async def body(client):
            await self.prefill(client, 31, 9)
            qs = [self.tensors(1)[0] for _ in range(5)]
            async with await client.open_decode_stream() as stream:
                tasks = [asyncio.ensure_future(stream.decode(0, [31], q)) for q in qs[:2]]
                tasks.append(asyncio.ensure_future(stream.decode(0, [404], qs[2])))
                tasks += [asyncio.ensure_future(stream.decode(0, [31], q)) for q in qs[3:]]
                results = await asyncio.gather(*tasks, return_exceptions=True)
            self.assertIsInstance(results[2], self.pagedattn.PagedAttnError)
            self.assertEqual(results[2].code.name, "NOT_FOUND")
            for i in (0, 1, 3, 4):
                t.assert_matches(self, results[i], self.mirror.expected(0, [31], qs[i], False))
            # A bad shape is refused before it is written; the stream stays usable.
            async with await client.open_decode_stream() as stream:
                with self.assertRaises(self.pagedattn.PagedAttnError) as ctx:
                    await stream.decode(0, [31], qs[0][:, :1])
                self.assertEqual(ctx.exception.code.name, "INVALID_ARGUMENT")
                result = await stream.decode(0, [31], qs[0])
                t.assert_matches(self, result, self.mirror.expected(0, [31], qs[0], False))
            await client.release(31)
        self.run_async(body)

    def test_cancelled_stream_fails_its_decodes(self):
        async def body(client):
            await self.prefill(client, 51, 3)
            q = self.tensors(1)[0]
            stream = await client.open_decode_stream()
            result = await stream.decode(0, [51], q)
            t.assert_matches(self, result, self.mirror.expected(0, [51], q, False))
            pending = asyncio.ensure_future(stream.decode(0, [51], q))
            await asyncio.sleep(0)  # written, maybe answered
            stream.cancel()
            done = await asyncio.gather(pending, return_exceptions=True)
            if isinstance(done[0], Exception):
                self.assertEqual(done[0].code.name, "CANCELLED")
            for call in (lambda: stream.decode(0, [51], q), stream.close):
                with self.assertRaises(self.pagedattn.PagedAttnError) as ctx:
                    await call()
                self.assertEqual(ctx.exception.code.name, "CANCELLED")
            self.assertEqual((await client.stats()).sequences, 1)
            await client.release(51)
        self.run_async(body)

    def test_server_going_away_fails_the_stream(self):
        async def body(client):
            async with self.pagedattn.AsyncClient(server.target) as other:
                await other.create(1)
                q = t.random_bf16(self.rng, (await other.model_config()).q_shape(1))
                stream = await other.open_decode_stream()
                await stream.decode(0, [1], q)
                server.kill()
                with self.assertRaises(self.pagedattn.PagedAttnError) as ctx:
                    await stream.decode(0, [1], q)
                self.assertEqual(ctx.exception.code.name, "UNAVAILABLE")
                with self.assertRaises(self.pagedattn.PagedAttnError) as ctx:
                    await stream.close()
                self.assertEqual(ctx.exception.code.name, "UNAVAILABLE")
                with self.assertRaises(self.pagedattn.PagedAttnError) as ctx:
                    await other.stats()
                self.assertEqual(ctx.exception.code.name, "UNAVAILABLE")
        with t.Server(t.ARGS.server, ["--num_pages=4", "--num_layers=1"]) as server:
            self.run_async(body)

    def test_errors_raise_status_codes(self):
        async def body(client):
            await self.prefill(client, 41, 4)
            before = await client.stats()
            with self.assertRaises(self.pagedattn.PagedAttnError) as ctx:
                await client.create(41)
            self.assertEqual(ctx.exception.code.name, "ALREADY_EXISTS")
            with self.assertRaises(self.pagedattn.PagedAttnError) as ctx:
                await client.fork(404, 42)
            self.assertEqual(ctx.exception.code.name, "NOT_FOUND")
            with self.assertRaises(self.pagedattn.PagedAttnError) as ctx:
                q, k, v = self.tensors(1)
                await client.decode(1, [41], q, k, v)
            self.assertEqual(ctx.exception.code.name, "FAILED_PRECONDITION")
            after = await client.stats()
            self.assertEqual((after.pages_free, after.sequences, after.tokens),
                             (before.pages_free, before.sequences, before.tokens))
            self.assertEqual(await client.health(), "SERVING")
            await client.release(41)
        self.run_async(body)


if __name__ == "__main__":
    t.main()
