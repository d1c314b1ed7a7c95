"""A client killed with SIGKILL while its decodes by reference are queued: the server stays
healthy, the region stays listed (nobody unregistered it) until another client unregisters it,
and every page comes back once the dead client's sequences are released.

usage: /usr/bin/python3 memory_kill_test.py --server=BIN --package=BUILD/python
(the test runs itself as the child with --child=TARGET)
"""

import os
import signal
import subprocess
import sys
import time
import unittest

import numpy as np

import package_testing as t

LAYERS, PAGES = 2, 256
IDS = [900, 901]


def child(target):
    """Registers a region, prints READY <name> <key>, then streams decode steps by reference
    (k, v, q in, output and lse out) without end, until it is killed."""
    import pagedattn  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(7)
    client = pagedattn.Client(target)
    client.wait_for_connected(20)
    cfg = client.config
    for sid in IDS:
        client.create(sid)
        for layer in range(LAYERS):
            client.append(sid, layer, t.random_bf16(rng, cfg.kv_shape(600)),
                          t.random_bf16(rng, cfg.kv_shape(600)))
    b = len(IDS)
    region = pagedattn.SystemRegion(1 << 20, client)
    q = region.put(t.random_bf16(rng, cfg.q_shape(b)))
    k = region.put(t.random_bf16(rng, cfg.kv_shape(b)))
    v = region.put(t.random_bf16(rng, cfg.kv_shape(b)))
    out = region.alloc(int(np.prod(cfg.q_shape(b))) * 2)
    lse = region.alloc(int(np.prod(cfg.lse_shape(b))) * 4)
    print("READY", region.name, region.key, flush=True)

    def calls():
        step = 0
        while True:
            yield pagedattn.DecodeCall(step % LAYERS, IDS, q, k, v, output=out, lse=lse)
            step += 1

    for result in client.decode_stream(calls()):
        result.check()


class KilledClientTest(unittest.TestCase):
    def test_sigkill_with_queued_referenced_decodes(self):
        import pagedattn  # pylint: disable=import-outside-toplevel
        server = t.Server(t.ARGS.server, [f"--num_pages={PAGES}", f"--num_layers={LAYERS}",
                                          "--cpu_threads=2"])
        self.addCleanup(server.kill)
        client = pagedattn.Client(server.target)
        self.addCleanup(client.close)
        client.wait_for_connected(20)
        total = client.stats().pages_total

        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__),
                                 f"--package={t.ARGS.package}", f"--child={server.target}"],
                                stdout=subprocess.PIPE, text=True)
        self.addCleanup(proc.stdout.close)
        self.addCleanup(proc.wait)
        self.addCleanup(lambda: proc.poll() is None and proc.kill())
        line = proc.stdout.readline().split()
        self.assertEqual(line[:1], ["READY"], "the child did not start")
        name, key = line[1], line[2]
        self.addCleanup(lambda: os.path.exists("/dev/shm" + key) and os.unlink("/dev/shm" + key))
        # Kill it while its work is queued in the server.
        deadline = time.monotonic() + 30
        queued = 0
        while queued == 0 and time.monotonic() < deadline:
            queued = client.stats().queue_depth
        self.assertGreater(queued, 0, "the child's decodes never queued")
        os.kill(proc.pid, signal.SIGKILL)
        self.assertEqual(proc.wait(10), -signal.SIGKILL)

        # The server is healthy and serves others.
        self.assertEqual(client.health(), "SERVING")
        self.assertTrue(client.stats().healthy)
        # The dead client's region is still listed; another client may unregister it.
        self.assertIn(name, [r.name for r in client.list_memory()])
        client.unregister_memory(name, timeout=30)
        self.assertEqual(client.list_memory(), [])
        # Its sequences still exist; after releasing them every page is free again.
        self.assertTrue(t.poll(lambda: client.stats().queue_depth == 0, 30))
        stats = client.stats()
        self.assertEqual(stats.sequences, len(IDS))
        self.assertGreater(stats.tokens, 600)
        for sid in IDS:
            client.release(sid)
        stats = client.stats()
        self.assertEqual((stats.pages_free, stats.pages_total, stats.sequences, stats.tokens),
                         (total, total, 0, 0))
        # And new work by reference goes on.
        rng = np.random.default_rng(3)
        client.create(1)
        cfg = client.config
        kv = t.random_bf16(rng, cfg.kv_shape(4))
        client.append(1, 0, kv, kv)
        client.append(1, 1, kv, kv)
        with pagedattn.SystemRegion(1 << 16, client) as region:
            q = t.random_bf16(rng, cfg.q_shape(1))
            np.testing.assert_array_equal(client.decode(0, [1], region.put(q)).output,
                                          client.decode(0, [1], q).output)
        client.release(1)
        self.assertIsNone(server.proc.poll(), "the server exited")


if __name__ == "__main__":
    if any(a.startswith("--child=") for a in sys.argv):
        target = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--child="))
        package = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--package="))
        sys.path.insert(0, package)
        child(target)
    else:
        t.main()
