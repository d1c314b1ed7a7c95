"""Security tests against the real pagedattn-server on loopback: TLS, mutual TLS and the bearer
token, with throwaway certificates made here with the openssl CLI (in a temp dir removed at
the end). Every server is killed on exit.

  security_test.py --server=pagedattn-server --cli=pagedattn-cli --health=pagedattn-health \
      --proto=proto/pagedattn/v1/pagedattn.proto
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
import grpc  # noqa: E402
from pagedattn_testing import Server  # noqa: E402

ARGS = None
TOKEN = "s3cr3t-token-for-tests"
SERVICE = "/pagedattn.v1.PagedAttention/"
TIMEOUT = 10


def identity(x):
    return x


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(d, name):
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)


def make_leaf(d, name, ca, ext):
    with open(os.path.join(d, f"{name}.ext"), "w") as f:
        f.write(ext)
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)


def rpcs(proto_path):
    """(name, (client streams, server streams)) of every rpc of the PagedAttention service, from
    the .proto, so an RPC added later is covered by the token tests without editing them."""
    with open(proto_path) as f:
        text = f.read()
    found = re.findall(r"rpc\s+(\w+)\s*\(\s*(stream\s+)?\w+\s*\)\s*returns\s*\(\s*(stream\s+)?", text)
    return [(name, (bool(ins), bool(outs))) for name, ins, outs in found]


def read(d, name):
    with open(os.path.join(d, name), "rb") as f:
        return f.read()


def rejected(server):
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read()
    m = re.search(rb'pagedattn_rejected_requests_total\{reason="unauthenticated"\} ([0-9.e+]+)', body)
    return float(m.group(1)) if m else 0.0


def health(channel):
    """grpc.health.v1.Health/Check for the whole server: the raw response (b'\\x08\\x01' = SERVING)."""
    check = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=identity,
                                response_deserializer=identity)
    return check(b"", timeout=TIMEOUT)


def unary(channel, method, metadata=None):
    call = channel.unary_unary(SERVICE + method, request_serializer=identity,
                               response_deserializer=identity)
    return call(b"", timeout=TIMEOUT, metadata=metadata)


def call_any(channel, method, kind, metadata=None):
    """An empty request to `method` of any arity (kind: (client streams, server streams))."""
    make = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
            (True, False): channel.stream_unary, (True, True): channel.stream_stream}[kind]
    call = make(SERVICE + method, request_serializer=identity, response_deserializer=identity)
    request = iter([b""]) if kind[0] else b""
    result = call(request, timeout=TIMEOUT, metadata=metadata)
    return list(result) if kind[1] else result


def stream(channel, requests, metadata=None):
    call = channel.stream_stream(SERVICE + "DecodeStream", request_serializer=identity,
                                 response_deserializer=identity)
    return list(call(iter(requests), timeout=TIMEOUT, metadata=metadata))


def code_of(fn):
    try:
        fn()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


class SecurityTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="pagedattn-security-")
        d = cls.dir
        make_ca(d, "ca")
        make_ca(d, "other-ca")
        make_leaf(d, "server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                  "basicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n")
        make_leaf(d, "client", "ca", "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n")
        make_leaf(d, "stranger", "other-ca", "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n")
        with open(os.path.join(d, "token"), "w") as f:
            f.write(TOKEN + "\n")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def p(self, name):
        return os.path.join(self.dir, name)

    def server(self, *flags):
        return Server(ARGS.server, ["--backend=cpu", "--num_pages=64", "--cpu_threads=1", *flags])

    def tls_flags(self, mutual=False):
        flags = [f"--tls_cert={self.p('server.pem')}", f"--tls_key={self.p('server.key')}"]
        if mutual:
            flags.append(f"--tls_client_ca={self.p('ca.pem')}")
        return flags

    def tls_channel(self, target, ca="ca.pem", cert=None):
        creds = grpc.ssl_channel_credentials(
            root_certificates=read(self.dir, ca),
            private_key=read(self.dir, cert + ".key") if cert else None,
            certificate_chain=read(self.dir, cert + ".pem") if cert else None)
        return grpc.secure_channel(target, creds)

    def test_tls(self):
        with self.server(*self.tls_flags()) as s:
            self.assertTrue(any("grpc tls on" in line for line in s.output), s.output)
            with self.tls_channel(s.target) as ch:
                self.assertEqual(health(ch), b"\x08\x01")
                self.assertTrue(len(unary(ch, "GetModelConfig")) > 0)
            # Also through the name in the certificate's DNS SAN.
            with self.tls_channel(f"localhost:{s.grpc_port}") as ch:
                self.assertEqual(code_of(lambda: unary(ch, "GetStats")), grpc.StatusCode.OK)
            with grpc.insecure_channel(s.target) as ch:
                self.assertEqual(code_of(lambda: unary(ch, "GetModelConfig")),
                                 grpc.StatusCode.UNAVAILABLE)
            # A client that does not trust the server's CA.
            with self.tls_channel(s.target, ca="other-ca.pem") as ch:
                self.assertEqual(code_of(lambda: unary(ch, "GetModelConfig")),
                                 grpc.StatusCode.UNAVAILABLE)
            # The C++ client library (pagedattn-cli) and the health probe over TLS.
            cli = subprocess.run([ARGS.cli, f"--target={s.target}", f"--tls_ca={self.p('ca.pem')}",
                                  "config"], capture_output=True, text=True, timeout=60)
            self.assertEqual(cli.returncode, 0, cli.stderr)
            probe = subprocess.run([ARGS.health, f"--address={s.target}", "--timeout=5s",
                                    f"--tls_ca={self.p('ca.pem')}"], capture_output=True, text=True,
                                   timeout=60)
            self.assertEqual(probe.returncode, 0, probe.stderr)
            plain = subprocess.run([ARGS.health, f"--address={s.target}", "--timeout=5s"],
                                   capture_output=True, text=True, timeout=60)
            self.assertNotEqual(plain.returncode, 0)

    def test_mutual_tls(self):
        with self.server(*self.tls_flags(mutual=True)) as s:
            with self.tls_channel(s.target, cert="client") as ch:
                self.assertEqual(health(ch), b"\x08\x01")
                self.assertEqual(code_of(lambda: unary(ch, "GetStats")), grpc.StatusCode.OK)
                self.assertEqual(code_of(lambda: stream(ch, [])), grpc.StatusCode.OK)
            with self.tls_channel(s.target) as ch:  # no client certificate
                self.assertEqual(code_of(lambda: unary(ch, "GetStats")), grpc.StatusCode.UNAVAILABLE)
                self.assertEqual(code_of(lambda: health(ch)), grpc.StatusCode.UNAVAILABLE)
            with self.tls_channel(s.target, cert="stranger") as ch:  # signed by another CA
                self.assertEqual(code_of(lambda: unary(ch, "GetStats")), grpc.StatusCode.UNAVAILABLE)
            with grpc.insecure_channel(s.target) as ch:
                self.assertEqual(code_of(lambda: unary(ch, "GetStats")), grpc.StatusCode.UNAVAILABLE)
            common = [ARGS.cli, f"--target={s.target}", f"--tls_ca={self.p('ca.pem')}"]
            ok = subprocess.run(common + [f"--tls_cert={self.p('client.pem')}",
                                          f"--tls_key={self.p('client.key')}", "stats"],
                                capture_output=True, text=True, timeout=60)
            self.assertEqual(ok.returncode, 0, ok.stderr)
            refused = subprocess.run(common + ["stats"], capture_output=True, text=True, timeout=60)
            self.assertNotEqual(refused.returncode, 0)
            probe = subprocess.run([ARGS.health, f"--address={s.target}", "--timeout=5s",
                                    f"--tls_ca={self.p('ca.pem')}", f"--tls_cert={self.p('client.pem')}",
                                    f"--tls_key={self.p('client.key')}"],
                                   capture_output=True, text=True, timeout=60)
            self.assertEqual(probe.returncode, 0, probe.stderr)

    def check_token(self, s, ch):
        methods = rpcs(ARGS.proto)
        self.assertGreaterEqual(len(methods), 17, methods)  # the tiers' and local channels' included
        good = [("authorization", "Bearer " + TOKEN)]
        bad = [None, [("authorization", "Bearer wrong")], [("authorization", "Bearer " + TOKEN + "x")],
               [("authorization", "Bearer " + TOKEN[:-1])], [("authorization", TOKEN)],
               [("authorization", "Basic " + TOKEN)]]
        before = rejected(s)
        expected = 0
        for name, kind in methods:
            for md in bad:
                code = code_of(lambda: call_any(ch, name, kind, metadata=md))
                self.assertEqual(code, grpc.StatusCode.UNAUTHENTICATED, (name, md))
                expected += 1
        self.assertEqual(rejected(s) - before, expected)
        # The right token: OK (the empty requests that need an id fail validation, not auth).
        self.assertTrue(len(unary(ch, "GetModelConfig", metadata=good)) > 0)
        self.assertEqual(code_of(lambda: unary(ch, "GetStats", metadata=good)), grpc.StatusCode.OK)
        self.assertEqual(code_of(lambda: stream(ch, [], metadata=good)), grpc.StatusCode.OK)
        self.assertEqual(len(stream(ch, [b""], metadata=good)), 1)  # an error response, stream OK
        # Health (for probes) needs no token.
        self.assertEqual(health(ch), b"\x08\x01")
        self.assertEqual(rejected(s) - before, expected)
        self.assertFalse(any(TOKEN in line for line in s.output), "the token was logged")

    def test_token_plaintext(self):
        with self.server(f"--auth_token_file={self.p('token')}") as s:
            with grpc.insecure_channel(s.target) as ch:
                self.check_token(s, ch)
            base = [ARGS.cli, f"--target={s.target}"]
            ok = subprocess.run(base + [f"--auth_token_file={self.p('token')}", "create", "7"],
                                capture_output=True, text=True, timeout=60)
            self.assertEqual(ok.returncode, 0, ok.stderr)
            no = subprocess.run(base + ["stats"], capture_output=True, text=True, timeout=60)
            self.assertNotEqual(no.returncode, 0)
            self.assertIn("UNAUTHENTICATED", no.stderr.upper())
            probe = subprocess.run([ARGS.health, f"--address={s.target}", "--timeout=5s"],
                                   capture_output=True, text=True, timeout=60)
            self.assertEqual(probe.returncode, 0, probe.stderr)

    def test_token_over_mutual_tls(self):
        with self.server(f"--auth_token_file={self.p('token')}", *self.tls_flags(mutual=True)) as s:
            with self.tls_channel(s.target, cert="client") as ch:
                self.check_token(s, ch)

    def test_bad_flags_refused(self):
        empty = self.p("empty-token")
        open(empty, "w").close()
        for flags in ([f"--tls_cert={self.p('server.pem')}"],
                      [f"--tls_key={self.p('server.key')}"],
                      [f"--tls_client_ca={self.p('ca.pem')}"],
                      [f"--tls_cert={self.p('missing.pem')}", f"--tls_key={self.p('server.key')}"],
                      [f"--auth_token_file={empty}"],
                      [f"--auth_token_file={self.p('missing-token')}"]):
            proc = subprocess.run([ARGS.server, "--grpc_address=127.0.0.1:0", "--metrics_address=",
                                   "--backend=cpu", "--num_pages=64", "--cpu_threads=1", *flags],
                                  capture_output=True, text=True, timeout=60)
            self.assertNotEqual(proc.returncode, 0, flags)
            self.assertIn("security flags", proc.stderr, flags)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--cli", required=True)
    parser.add_argument("--health", required=True)
    parser.add_argument("--proto", required=True)
    ARGS, rest = parser.parse_known_args()
    unittest.main(argv=[sys.argv[0], *rest], verbosity=2)
