"""Errors of pagedattn.Client against the real pagedattn-server: every failure is a
PagedAttnError with the most specific status code, from the server (state unchanged, checked
with stats and a decode that must return the same bits) or from the client's own checks
(nothing sent); connection options (message limit, deadline, bearer token, TLS and mutual TLS
with throwaway certificates made by the openssl CLI).

usage: /usr/bin/python3 errors_test.py --server=BIN --package=BUILD/python
"""

import os
import shutil
import sys
import tempfile
import unittest

import numpy as np

import package_testing as t

sys.path.insert(0, os.path.join(t.HERE, "..", "security"))
from security_test import make_ca, make_leaf  # noqa: E402  pylint: disable=wrong-import-position

LAYERS, PAGES = 2, 8
TOKEN = "python-package-token"


class ServerErrorsTest(t.ServerCase):
    LAYERS, PAGES = LAYERS, PAGES

    def setUp(self):
        super().setUp()
        c = self.config
        self.client.create(1)
        for layer in range(LAYERS):
            self.client.append(1, layer, t.random_bf16(self.rng, c.kv_shape(70)),
                               t.random_bf16(self.rng, c.kv_shape(70)))
        self.q = t.random_bf16(self.rng, c.q_shape(1))

    def tearDown(self):
        self.client.release(1)

    def snapshot(self):
        s = self.client.stats()
        outputs = [self.client.decode(layer, [1], self.q) for layer in range(LAYERS)]
        return (s.pages_free, s.sequences, s.tokens), outputs

    def assert_code(self, code, call):
        with self.assertRaises(self.pa.PagedAttnError) as ctx:
            call()
        self.assertEqual(ctx.exception.code.name, code, ctx.exception.message)
        self.assertTrue(ctx.exception.message)
        self.assertIn(code, str(ctx.exception))

    def test_server_errors_change_nothing(self):
        c, cl, rng = self.config, self.client, self.rng
        kv1 = t.random_bf16(rng, c.kv_shape(1))
        q2 = t.random_bf16(rng, c.q_shape(2))
        big = c.num_pages * c.page_size  # more tokens than the pool holds
        cases = [
            ("NOT_FOUND", lambda: cl.release(404)),
            ("NOT_FOUND", lambda: cl.append(404, 0, kv1, kv1)),
            ("NOT_FOUND", lambda: cl.decode(0, [404], self.q)),
            ("NOT_FOUND", lambda: cl.fork(404, 2)),
            ("ALREADY_EXISTS", lambda: cl.create(1)),
            ("ALREADY_EXISTS", lambda: cl.fork(1, 1)),
            ("INVALID_ARGUMENT", lambda: cl.decode(0, [1, 1], q2)),
            ("INVALID_ARGUMENT", lambda: cl.decode(LAYERS, [1], self.q)),
            ("INVALID_ARGUMENT", lambda: cl.decode(-1, [1], self.q)),
            ("INVALID_ARGUMENT", lambda: cl.decode(0, [1], self.q, sm_scale=-1.0)),
            ("INVALID_ARGUMENT", lambda: cl.decode(0, [1], self.q, sm_scale=float("nan"))),
            ("INVALID_ARGUMENT", lambda: cl.decode(0, [], np.zeros(c.q_shape(0), np.float32))),
            ("FAILED_PRECONDITION", lambda: cl.append(1, 1, kv1, kv1)),
            ("FAILED_PRECONDITION", lambda: cl.decode(1, [1], self.q, kv1, kv1)),
            ("RESOURCE_EXHAUSTED", lambda: cl.append(1, 0, t.random_bf16(rng, c.kv_shape(big)),
                                                    t.random_bf16(rng, c.kv_shape(big)))),
        ]
        before = self.snapshot()
        for code, call in cases:
            self.assert_code(code, call)
        after = self.snapshot()
        self.assertEqual(after[0], before[0])
        for b, a in zip(before[1], after[1]):
            np.testing.assert_array_equal(a.output, b.output)
            np.testing.assert_array_equal(a.lse, b.lse)

    def test_batch_larger_than_max_batch_size(self):
        c = self.config
        b = c.max_batch_size + 1
        ids = list(range(1000, 1000 + b))
        self.assert_code("INVALID_ARGUMENT",
                         lambda: self.client.decode(0, ids, t.random_bf16(self.rng, c.q_shape(b))))

    def test_client_refuses_bad_tensors_before_sending(self):
        c, cl = self.config, self.client
        before = self.client.stats()
        kv = t.random_bf16(self.rng, c.kv_shape(2))
        wrong_heads = t.random_bf16(self.rng, (2, c.num_kv_heads + 1, c.head_dim))
        cases = [
            lambda: cl.append(1, 0, wrong_heads, wrong_heads),
            lambda: cl.append(1, 0, kv, kv[:1]),
            lambda: cl.append(1, 0, kv.reshape(2, -1), kv.reshape(2, -1)),
            lambda: cl.append(1, 0, kv.astype(np.int32), kv.astype(np.int32)),
            lambda: cl.append(1, 0, kv.tolist(), kv.tolist()),
            lambda: cl.append(1, 0, kv, None),
            lambda: cl.decode(0, [1], self.q[:, :, :-1]),
            lambda: cl.decode(0, [1, 2], self.q),
            lambda: cl.decode(0, [1], self.q, k=kv[:1]),
            lambda: cl.decode(0, [1], self.q, k=kv, v=kv),
            lambda: cl.create(-1),
            lambda: cl.create(2**64),
            lambda: cl.create(True),
            lambda: cl.create("7"),
            lambda: cl.fork(1, -2),
        ]
        for call in cases:
            self.assert_code("INVALID_ARGUMENT", call)
        after = self.client.stats()
        self.assertEqual((after.pages_free, after.sequences, after.tokens, after.batches),
                         (before.pages_free, before.sequences, before.tokens, before.batches))

    def test_unsigned_64_bit_ids(self):
        self.client.create(2**64 - 1)
        self.client.fork(2**64 - 1, 2**63)
        self.client.release(2**63)
        self.client.release(2**64 - 1)
        self.assert_code("NOT_FOUND", lambda: self.client.release(2**64 - 1))

    def test_message_limit(self):
        c = self.config
        with self.pa.Client(self.server.target, max_message_bytes=4096) as small:
            kv = t.random_bf16(self.rng, c.kv_shape(64))
            self.assert_code("RESOURCE_EXHAUSTED", lambda: small.append(1, 0, kv, kv))
        self.assertEqual(self.client.stats().tokens, 70)


class OptionsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import pagedattn  # pylint: disable=import-outside-toplevel
        cls.pa = pagedattn
        cls.dir = tempfile.mkdtemp(prefix="pagedattn-python-")
        make_ca(cls.dir, "ca")
        make_ca(cls.dir, "other-ca")
        make_leaf(cls.dir, "server", "ca", "subjectAltName=DNS:pagedattn.test\n"
                  "basicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n")
        make_leaf(cls.dir, "client", "ca",
                  "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n")
        with open(cls.p("token"), "w") as f:
            f.write(TOKEN + "\n")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    @classmethod
    def p(cls, name):
        return os.path.join(cls.dir, name)

    def assert_code(self, code, call):
        with self.assertRaises(self.pa.PagedAttnError) as ctx:
            call()
        self.assertEqual(ctx.exception.code.name, code, ctx.exception.message)

    def test_invalid_options(self):
        self.assert_code("INVALID_ARGUMENT", lambda: self.pa.Client(""))
        for fields in ({"max_message_bytes": 1023}, {"max_message_bytes": 2**31},
                       {"tls_cert_file": self.p("client.pem")},
                       {"tls_ca_file": self.p("missing.pem")}, {"no_such_option": 1}):
            self.assert_code("INVALID_ARGUMENT", lambda f=fields: self.pa.Client("x:1", **f))
        options = self.pa.ClientOptions(target="x:1", timeout=3)
        self.assertEqual(self.pa.Client(options=options, bearer_token="t").options,
                         self.pa.ClientOptions(target="x:1", timeout=3, bearer_token="t"))

    def test_unreachable_server(self):
        with t.Server(t.ARGS.server, ["--num_pages=4"]) as s:
            target = s.target
        with self.pa.Client(target, timeout=5) as client:
            self.assert_code("UNAVAILABLE", client.stats)
            self.assert_code("DEADLINE_EXCEEDED", lambda: client.wait_for_connected(0.2))
        with self.pa.Client(target, timeout=0.3, wait_for_ready=True) as patient:
            self.assert_code("DEADLINE_EXCEEDED", patient.stats)

    def test_bearer_token_and_mutual_tls(self):
        flags = ["--num_pages=4", f"--auth_token_file={self.p('token')}",
                 f"--tls_cert={self.p('server.pem')}", f"--tls_key={self.p('server.key')}",
                 f"--tls_client_ca={self.p('ca.pem')}"]
        with t.Server(t.ARGS.server, flags) as s:
            good = dict(tls_ca_file=self.p("ca.pem"), tls_cert_file=self.p("client.pem"),
                        tls_key_file=self.p("client.key"), tls_server_name="pagedattn.test")
            with self.pa.Client(s.target, bearer_token=TOKEN, **good) as client:
                self.assertEqual(client.stats().sequences, 0)
                self.assertEqual(client.health(), "SERVING")
                client.create(5)
                client.release(5)
            with self.pa.Client(s.target, bearer_token="wrong", **good) as client:
                self.assert_code("UNAUTHENTICATED", lambda: client.create(5))
            with self.pa.Client(s.target, **good) as client:
                self.assert_code("UNAUTHENTICATED", client.stats)
            wrong_ca = dict(good, tls_ca_file=self.p("other-ca.pem"))
            with self.pa.Client(s.target, bearer_token=TOKEN, timeout=5, **wrong_ca) as client:
                self.assert_code("UNAVAILABLE", client.stats)
            with self.pa.Client(s.target, bearer_token=TOKEN, timeout=5) as plaintext:
                self.assert_code("UNAVAILABLE", plaintext.stats)


if __name__ == "__main__":
    t.main()
