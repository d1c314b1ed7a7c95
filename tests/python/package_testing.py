"""Helpers for the tests of the pagedattn Python package: the real server (started by
tests/integration/pagedattn_testing.Server), random bf16 tensors, a numpy reference of the
decode attention, and a mirror of what the server holds. Shapes come from the server's
ModelConfig, never from constants here."""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
from pagedattn_testing import Server, check_no_sanitizer_report, poll  # noqa: E402,F401  pylint: disable=wrong-import-position

ARGS = None


def main(extra=()):
    """unittest main with --server=BIN --package=DIR (the build tree's python folder) and any
    `extra` flags (name, kwargs) the test needs; ARGS holds them."""
    global ARGS  # pylint: disable=global-statement
    parser = argparse.ArgumentParser()
    parser.add_argument("--server")
    parser.add_argument("--package")
    for name, kwargs in extra:
        parser.add_argument(name, **kwargs)
    ARGS, rest = parser.parse_known_args()
    if ARGS.package:
        sys.path.insert(0, ARGS.package)
    unittest.main(argv=[sys.argv[0], "-v", *rest])


def random_bf16(rng, shape):
    """Normal(0, 1) values, rounded to bf16 (float32 holding bf16 values, so the client's
    conversion is exact and the reference sees what the server sees)."""
    import pagedattn  # pylint: disable=import-outside-toplevel
    return pagedattn.bf16.from_bits(pagedattn.bf16.to_bits(rng.standard_normal(shape, np.float32)))


def reference(q, keys, values, sm_scale):
    """One sequence at one layer: q [Hq, D], keys/values [n, Hkv, D] -> (output [Hq, D],
    lse [Hq] base 2), in float64."""
    hq, d = q.shape
    if len(keys) == 0:
        return np.zeros((hq, d)), np.full(hq, -np.inf)
    group = hq // keys.shape[1]
    k = np.repeat(keys.astype(np.float64), group, axis=1)    # [n, Hq, D]
    v = np.repeat(values.astype(np.float64), group, axis=1)
    scores = sm_scale * np.einsum("hd,nhd->hn", q.astype(np.float64), k)
    m = scores.max(axis=1, keepdims=True)
    w = np.exp(scores - m)
    total = w.sum(axis=1, keepdims=True)
    out = np.einsum("hn,nhd->hd", w / total, v)
    lse = (m[:, 0] + np.log(total[:, 0])) / np.log(2.0)
    return out, lse


class Mirror:
    """What the server should hold: per sequence and layer the K and V rows, and the committed
    length (the rows of the last layer)."""

    def __init__(self, config):
        self.config = config
        self.seqs = {}

    def create(self, sid):
        empty = np.zeros(self.config.kv_shape(0), np.float32)
        self.seqs[sid] = [[empty, empty] for _ in range(self.config.num_layers)]

    def fork(self, parent, child):
        self.seqs[child] = [list(kv) for kv in self.seqs[parent]]

    def append(self, sid, layer, k, v):
        kv = self.seqs[sid][layer]
        kv[0] = np.concatenate([kv[0], k])
        kv[1] = np.concatenate([kv[1], v])

    def length(self, sid):
        return len(self.seqs[sid][self.config.num_layers - 1][0])

    def expected(self, layer, sids, q, with_new_token, sm_scale=0.0):
        """(output [B, Hq, D], lse [B, Hq]) of a decode at `layer` (after its k/v, if any, went
        into the mirror): a step attends over the layer's rows, attend-only over committed
        rows."""
        scale = sm_scale or 1.0 / np.sqrt(self.config.head_dim)
        outs, lses = [], []
        for b, sid in enumerate(sids):
            k, v = self.seqs[sid][layer]
            n = len(k) if with_new_token else self.length(sid)
            o, l = reference(q[b], k[:n], v[:n], scale)
            outs.append(o)
            lses.append(l)
        return np.stack(outs), np.stack(lses)


def assert_matches(test, result, want, msg=""):
    """Decode result vs reference: relative L2 of the output (bf16 rounding) and lse."""
    want_out, want_lse = want
    test.assertEqual(result.output.shape, want_out.shape, msg)
    test.assertEqual(result.lse.shape, want_lse.shape, msg)
    for b in range(len(want_out)):
        err = np.linalg.norm(result.output[b] - want_out[b])
        norm = np.linalg.norm(want_out[b])
        test.assertLess(err / norm if norm else err, 1e-2, f"{msg} row {b}")
    np.testing.assert_allclose(result.lse, want_lse, rtol=0, atol=1e-3, err_msg=msg)


class UnixServer:
    """The server listening on a Unix socket (--grpc_address=unix:PATH) in a fresh temporary
    folder; target is "unix:PATH". Killed (and the folder removed) by kill()."""

    _SERVING = re.compile(r"serving grpc=unix:(\S+)")

    def __init__(self, binary, flags=(), timeout=30.0):
        self._dir = tempfile.mkdtemp(prefix="pa-py-")
        path = os.path.join(self._dir, "grpc.sock")
        self.proc = subprocess.Popen(
            [binary, f"--grpc_address=unix:{path}", "--metrics_address=127.0.0.1:0", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.output = []
        ready = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.output.append(line)
                if self._SERVING.search(line):
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(timeout) or self.proc.poll() is not None:
            self.kill()
            raise RuntimeError("server did not start:\n" + "".join(self.output))
        match = self._SERVING.search("".join(self.output))
        self.target = f"unix:{match.group(1)}"

    def kill(self):
        """Kills the server if it still runs; AssertionError if it printed a sanitizer report."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)
        check_no_sanitizer_report("".join(self.output))


class ServerCase(unittest.TestCase):
    """A real CPU-backend server of LAYERS layers and PAGES pages (on a Unix socket when the
    test was given --unix) and a connected pagedattn.Client, shared by the class's tests; each
    test gets its own seeded numpy generator. The package is `cls.pa`. SERVER_FLAGS: more
    server flags (a model shape, say)."""
    LAYERS, PAGES = 2, 32
    SERVER_FLAGS = ()

    @classmethod
    def setUpClass(cls):
        import pagedattn  # pylint: disable=import-outside-toplevel
        cls.pa = pagedattn
        flags = [f"--num_pages={cls.PAGES}", f"--num_layers={cls.LAYERS}", "--cpu_threads=2",
                 *cls.SERVER_FLAGS]
        on_unix = getattr(ARGS, "unix", False)
        cls.server = UnixServer(ARGS.server, flags) if on_unix else Server(ARGS.server, flags)
        cls.client = pagedattn.Client(cls.server.target)
        cls.client.wait_for_connected(20)
        cls.config = cls.client.config

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.kill()

    def setUp(self):
        self.rng = np.random.default_rng(abs(hash(self.id())) % 2**32)
