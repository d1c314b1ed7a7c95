"""The Python client's KV-tier calls against a real server: export_sequence / import_sequence
(the copy decodes bitwise like the original), by reference through a SystemRegion (the region
holds the documented layout, the import by reference decodes bitwise), offload (the host tier's counters, the transparent
restore, the metrics), the same with AsyncClient, and clients killed with SIGKILL in the middle
of an export and of an import (the server stays healthy and keeps nothing of them).

usage: /usr/bin/python3 kv_tiers_test.py --server=BIN --package=BUILD/python
(the test runs itself as the child with --child=MODE,TARGET)
"""

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import unittest
import urllib.request

import numpy as np

import package_testing as t

LAYERS, PAGES, HOST_PAGES = 2, 64, 8
HOST_BYTES = HOST_PAGES * LAYERS * 2 * 64 * 1024
BIG_ID, BIG_TOKENS = 500, 4000


def metric(port, name):
    """The sum of a metric's samples on the server's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$",
                                                        text, re.M))


class KvTiersClientTest(t.ServerCase):
    LAYERS, PAGES = LAYERS, PAGES
    SERVER_FLAGS = (f"--host_kv_bytes={HOST_BYTES}",)

    def prefill(self, mirror, sid, tokens):
        self.client.create(sid)
        mirror.create(sid)
        for layer in range(self.LAYERS):
            k = t.random_bf16(self.rng, self.config.kv_shape(tokens))
            v = t.random_bf16(self.rng, self.config.kv_shape(tokens))
            self.client.append(sid, layer, k, v)
            mirror.append(sid, layer, k, v)

    def test_export_import_and_offload(self):
        c, pa = self.client, self.pa
        mirror = t.Mirror(self.config)
        self.prefill(mirror, 10, 100)
        chunks = c.export_sequence(10)
        self.assertEqual([(x.layer, x.first_token, x.num_tokens) for x in chunks],
                         [(0, 0, 100), (1, 0, 100)])
        self.assertEqual(c.import_sequence(11, chunks), 100)
        mirror.fork(10, 11)
        with self.assertRaises(pa.PagedAttnError) as ctx:
            c.import_sequence(11, chunks)
        self.assertEqual(ctx.exception.code.name, "ALREADY_EXISTS")
        with self.assertRaises(pa.PagedAttnError) as ctx:
            c.export_sequence(999)
        self.assertEqual(ctx.exception.code.name, "NOT_FOUND")
        q = t.random_bf16(self.rng, self.config.q_shape(1))
        original = c.decode(1, [10], q)
        t.assert_matches(self, original, mirror.expected(1, [10], q, False))
        np.testing.assert_array_equal(c.decode(1, [11], q).output, original.output)

        stats = c.stats()
        self.assertEqual((stats.host_pages_total, stats.host_pages_free), (HOST_PAGES, HOST_PAGES))
        offloads = metric(self.server.metrics_port, "pagedattn_kv_offloads_total")
        c.offload(11)
        stats = c.stats()
        self.assertEqual((stats.sequences_offloaded, stats.host_pages_free), (1, HOST_PAGES - 2))
        self.assertEqual(metric(self.server.metrics_port, "pagedattn_kv_offloads_total"), offloads + 1)
        self.assertEqual(metric(self.server.metrics_port, "pagedattn_sequences_offloaded"), 1)
        # The next decode brings it back, the same bytes.
        restored = c.decode(1, [11], q)
        np.testing.assert_array_equal(restored.output, original.output)
        np.testing.assert_array_equal(restored.lse, original.lse)
        stats = c.stats()
        self.assertEqual((stats.sequences_offloaded, stats.host_pages_free), (0, HOST_PAGES))
        port = self.server.metrics_port
        self.assertGreaterEqual(metric(port, "pagedattn_kv_restores_total"), 1)
        self.assertGreaterEqual(metric(port, "pagedattn_kv_tier_bytes_total"),
                                2 * 2 * LAYERS * 2 * 64 * 1024)
        self.assertGreaterEqual(
            metric(port, 'pagedattn_stage_duration_seconds_count{stage="restore"}'.split("{")[0]), 1)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        self.assertRegex(text, r'pagedattn_stage_duration_seconds_count\{stage="restore"\} [1-9]')
        self.assertEqual(metric(port, "pagedattn_host_kv_pages_total"), HOST_PAGES)
        for sid in (10, 11):
            c.release(sid)

    def test_export_import_through_a_system_region(self):
        c, pa = self.client, self.pa
        mirror = t.Mirror(self.config)
        self.prefill(mirror, 30, 150)
        inline = c.export_sequence(30)
        row = self.config.num_kv_heads * self.config.head_dim * 2
        need = 2 * LAYERS * 150 * row
        with pa.SystemRegion(need + 64, c) as region:
            # Too small: refused, nothing written.
            region.array(0, np.uint8, (region.size,))[...] = 7
            with self.assertRaises(pa.PagedAttnError) as ctx:
                c.export_sequence(30, destination=region.ref(16, need - row))
            self.assertEqual(ctx.exception.code.name, "INVALID_ARGUMENT")
            self.assertTrue((region.array(0, np.uint8, (region.size,)) == 7).all())

            chunks = c.export_sequence(30, destination=region.ref(16, need))
            self.assertEqual([(x.layer, x.num_tokens, len(x.k), x.k_ref.offset, x.v_ref.offset)
                              for x in chunks],
                             [(0, 150, 0, 16, 16 + 150 * row),
                              (1, 150, 0, 16 + 2 * 150 * row, 16 + 3 * 150 * row)])
            layout = b"".join(x.k + x.v for x in inline)
            self.assertEqual(region.array(16, np.uint8, (need,)).tobytes(), layout)
            self.assertTrue((region.array(0, np.uint8, (16,)) == 7).all())
            self.assertTrue((region.array(16 + need, np.uint8, (region.size - 16 - need,)) == 7).all())
            # Imported by reference, and by bytes read out of the region.
            self.assertEqual(c.import_sequence(31, chunks), 150)
            as_bytes = []
            for x in chunks:
                y = pa.v1.pagedattn_pb2.ExportSequenceChunk()
                y.CopyFrom(x)
                y.ClearField("k_ref")
                y.ClearField("v_ref")
                y.k = region.array(x.k_ref.offset, np.uint8, (x.k_ref.byte_size,)).tobytes()
                y.v = region.array(x.v_ref.offset, np.uint8, (x.v_ref.byte_size,)).tobytes()
                as_bytes.append(y)
            self.assertEqual(c.import_sequence(32, as_bytes), 150)
        q = t.random_bf16(self.rng, self.config.q_shape(1))
        for layer in range(LAYERS):
            original = c.decode(layer, [30], q)
            t.assert_matches(self, original, mirror.expected(layer, [30], q, False))
            for copy in (31, 32):
                got = c.decode(layer, [copy], q)
                np.testing.assert_array_equal(got.output, original.output)
                np.testing.assert_array_equal(got.lse, original.lse)
        for sid in (30, 31, 32):
            c.release(sid)

    def test_async_client(self):
        pa = self.pa
        mirror = t.Mirror(self.config)
        self.prefill(mirror, 20, 70)
        q = t.random_bf16(self.rng, self.config.q_shape(1))
        want = self.client.decode(0, [20], q)

        async def main():
            async with pa.AsyncClient(self.server.target) as c:
                chunks = await c.export_sequence(20)
                self.assertEqual(len(chunks), LAYERS)
                self.assertEqual(await c.import_sequence(21, chunks), 70)
                await c.offload(21)
                self.assertEqual((await c.stats()).sequences_offloaded, 1)
                region = await pa.SystemRegion(2 * LAYERS * 70 * 1024).register_async(c)
                async with region:
                    by_ref = await c.export_sequence(20, destination=region.ref(0, region.size))
                    self.assertEqual([x.k_ref.byte_size for x in by_ref], [70 * 1024] * LAYERS)
                    self.assertEqual(await c.import_sequence(22, by_ref), 70)
                np.testing.assert_array_equal((await c.decode(0, [22], q)).output, want.output)
                await c.release(22)
                got = await c.decode(0, [21], q)
                np.testing.assert_array_equal(got.output, want.output)
                await c.release(20)
                await c.release(21)

        asyncio.run(main())


def child(mode, target):
    """export: reads one chunk of BIG_ID's export and stops reading; import: streams the first
    chunks of an import of a new id and stops. Prints READY, then waits to be killed."""
    import pagedattn  # pylint: disable=import-outside-toplevel
    from pagedattn.v1 import pagedattn_pb2 as pb  # pylint: disable=import-outside-toplevel
    client = pagedattn.Client(target)
    client.wait_for_connected(20)
    stub = client._stub  # pylint: disable=protected-access
    if mode == "export":
        stream = stub.ExportSequence(pb.ExportSequenceRequest(sequence_id=BIG_ID))
        next(stream)
        print("READY", flush=True)
        while True:
            time.sleep(1)
    chunks = list(client.export_sequence(BIG_ID))

    def requests():
        for i, c in enumerate(chunks[:5]):
            m = pb.ImportSequenceChunk(layer=c.layer, first_token=c.first_token,
                                       num_tokens=c.num_tokens, k=c.k, v=c.v)
            if i == 0:
                m.sequence_id, m.length = 777, c.length
            yield m
        print("READY", flush=True)
        while True:
            time.sleep(1)

    stub.ImportSequence(requests())


class KilledClientTest(unittest.TestCase):
    def kill_child_in(self, mode):
        import pagedattn  # pylint: disable=import-outside-toplevel
        server = t.Server(t.ARGS.server, [f"--num_pages={2 * PAGES}", f"--num_layers={LAYERS}",
                                          "--cpu_threads=2"])
        self.addCleanup(server.kill)
        client = pagedattn.Client(server.target)
        self.addCleanup(client.close)
        client.wait_for_connected(20)
        rng = np.random.default_rng(5)
        cfg = client.config
        client.create(BIG_ID)
        for layer in range(LAYERS):
            kv = t.random_bf16(rng, cfg.kv_shape(BIG_TOKENS))
            client.append(BIG_ID, layer, kv, kv)
        before = client.stats()
        exported = client.export_sequence(BIG_ID)

        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__),
                                 f"--package={t.ARGS.package}", f"--child={mode},{server.target}"],
                                stdout=subprocess.PIPE, text=True)
        self.addCleanup(proc.stdout.close)
        self.addCleanup(proc.wait)
        self.addCleanup(lambda: proc.poll() is None and proc.kill())
        self.assertEqual(proc.stdout.readline().split()[:1], ["READY"], "the child did not start")
        time.sleep(0.2)  # its stream is under way in the server
        os.kill(proc.pid, signal.SIGKILL)
        self.assertEqual(proc.wait(10), -signal.SIGKILL)

        self.assertEqual(client.health(), "SERVING")
        # A dead importer's pages come back once the server sees its stream end.
        self.assertTrue(t.poll(lambda: client.stats().queue_depth == 0 and
                               client.stats().pages_free == before.pages_free, 30))
        after = client.stats()
        self.assertTrue(after.healthy)
        self.assertEqual((after.sequences, after.pages_free, after.tokens),
                         (before.sequences, before.pages_free, before.tokens))
        with self.assertRaises(pagedattn.PagedAttnError) as ctx:
            client.export_sequence(777)
        self.assertEqual(ctx.exception.code.name, "NOT_FOUND")
        # Both streams work in full afterwards, and every page comes back.
        self.assertEqual([c.SerializeToString() for c in client.export_sequence(BIG_ID)],
                         [c.SerializeToString() for c in exported])
        self.assertEqual(client.import_sequence(777, exported), BIG_TOKENS)
        client.release(777)
        client.release(BIG_ID)
        stats = client.stats()
        self.assertEqual((stats.pages_free, stats.sequences), (stats.pages_total, 0))
        self.assertIsNone(server.proc.poll(), "the server exited")

    def test_sigkill_mid_export(self):
        self.kill_child_in("export")

    def test_sigkill_mid_import(self):
        self.kill_child_in("import")


if __name__ == "__main__":
    if any(a.startswith("--child=") for a in sys.argv):
        mode, target = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--child=")).split(",", 1)
        package = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--package="))
        sys.path.insert(0, package)
        child(mode, target)
    else:
        t.main()
