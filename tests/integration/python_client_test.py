"""A Python client of the real pagedattn-server: Debian's python3-grpcio with stubs generated at
build time by Debian's protoc and grpc_python_plugin. Creates, appends, decodes (unary and
streaming), forks and releases, checking every result against a pure-Python reference.

usage: /usr/bin/python3 python_client_test.py --server=BIN --stubs=DIR
"""

import argparse
import math
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pagedattn_testing as t  # noqa: E402

ARGS = None
MAX_MESSAGE = 64 << 20


class PythonClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        sys.path.insert(0, ARGS.stubs)
        global grpc, pb, pb_grpc  # pylint: disable=global-statement
        import grpc  # noqa: F401
        from pagedattn.v1 import pagedattn_pb2 as pb
        from pagedattn.v1 import pagedattn_pb2_grpc as pb_grpc
        cls.server = t.Server(ARGS.server, ["--num_pages=32", "--num_layers=2", "--cpu_threads=2"])
        cls.channel = grpc.insecure_channel(cls.server.target, options=[
            ("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.max_receive_message_length", MAX_MESSAGE)])
        grpc.channel_ready_future(cls.channel).result(timeout=20)
        cls.stub = pb_grpc.PagedAttentionStub(cls.channel)

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        cls.server.kill()

    def setUp(self):
        self.rng = t.new_rng(hash(self.id()) & 0xFFFFFFFF)
        # Mirror: id -> {"k": [layer][token] floats, "v": ..., "len": committed}
        self.mirror = {}

    def create(self, sid):
        self.stub.CreateSequence(pb.CreateSequenceRequest(sequence_id=sid), timeout=10)
        self.mirror[sid] = {"k": [[], []], "v": [[], []], "len": 0}

    def append(self, sid, layer, n):
        kb, kf = t.random_bf16(n * 512, self.rng)
        vb, vf = t.random_bf16(n * 512, self.rng)
        r = self.stub.AppendKV(pb.AppendKVRequest(sequence_id=sid, layer=layer, num_tokens=n,
                                                  k=kb, v=vb), timeout=10)
        m = self.mirror[sid]
        m["k"][layer] += [kf[i * 512:(i + 1) * 512] for i in range(n)]
        m["v"][layer] += [vf[i * 512:(i + 1) * 512] for i in range(n)]
        if layer == 1:
            m["len"] += n
        self.assertEqual(r.length, m["len"])

    def decode_request(self, rid, layer, ids, with_kv, sm_scale=0.0):
        qb, qf = t.random_bf16(len(ids) * 24 * 128, self.rng)
        req = pb.DecodeRequest(request_id=rid, layer=layer, sequence_ids=ids, q=qb, sm_scale=sm_scale)
        new_kv = None
        if with_kv:
            kb, kf = t.random_bf16(len(ids) * 512, self.rng)
            vb, vf = t.random_bf16(len(ids) * 512, self.rng)
            req.k, req.v = kb, vb
            new_kv = (kf, vf)
        return req, qf, new_kv

    def check(self, req, qf, new_kv, resp):
        self.assertEqual(resp.request_id, req.request_id)
        self.assertEqual(resp.error_code, 0, resp.error_message)
        out = t.decode_bf16(resp.output)
        lse = t.decode_f32(resp.lse)
        self.assertEqual(len(out), len(req.sequence_ids) * 24 * 128)
        self.assertEqual(len(lse), len(req.sequence_ids) * 24)
        scale = req.sm_scale or 1.0 / math.sqrt(128.0)
        for b, sid in enumerate(req.sequence_ids):
            m = self.mirror[sid]
            if new_kv is not None:
                m["k"][req.layer].append(new_kv[0][b * 512:(b + 1) * 512])
                m["v"][req.layer].append(new_kv[1][b * 512:(b + 1) * 512])
                if req.layer == 1:
                    m["len"] += 1
                n = len(m["k"][req.layer])
            else:
                n = m["len"]
            want_out, want_lse = t.reference(qf[b * 3072:(b + 1) * 3072], m["k"][req.layer][:n],
                                             m["v"][req.layer][:n], scale)
            self.assertLess(t.rel_l2(out[b * 3072:(b + 1) * 3072], want_out), 1e-2, f"sequence {sid}")
            for h in range(24):
                self.assertAlmostEqual(lse[b * 24 + h], want_lse[h], delta=1e-3,
                                       msg=f"sequence {sid} head {h}")

    def stats(self):
        return self.stub.GetStats(pb.GetStatsRequest(), timeout=10)

    def test_config(self):
        c = self.stub.GetModelConfig(pb.GetModelConfigRequest(), timeout=10)
        self.assertEqual((c.num_qo_heads, c.num_kv_heads, c.head_dim, c.page_size), (24, 4, 128, 64))
        self.assertEqual((c.num_layers, c.num_pages, c.backend), (2, 32, "cpu"))
        self.assertEqual(c.max_message_bytes, 64 << 20)

    def test_create_append_decode_fork_release(self):
        before = self.stats()
        self.create(11)
        self.create(12)
        for layer in (0, 1):
            self.append(11, layer, 65)
            self.append(12, layer, 3)
        # A decode step over both layers, then attend-only with an explicit scale.
        for layer in (0, 1):
            req, qf, kv = self.decode_request(1, layer, [11, 12], True)
            self.check(req, qf, kv, self.stub.Decode(req, timeout=30))
        req, qf, kv = self.decode_request(2, 0, [12, 11], False, sm_scale=0.2)
        self.check(req, qf, kv, self.stub.Decode(req, timeout=30))
        s = self.stats()
        self.assertEqual(s.sequences - before.sequences, 2)
        self.assertEqual(s.tokens - before.tokens, 66 + 4)
        self.assertEqual(before.pages_free - s.pages_free, 3)
        # Fork: the child reads the parent's tokens, and its step copies the shared last page.
        self.stub.ForkSequence(pb.ForkSequenceRequest(parent_id=12, child_id=13), timeout=10)
        self.mirror[13] = {"k": [list(x) for x in self.mirror[12]["k"]],
                           "v": [list(x) for x in self.mirror[12]["v"]], "len": self.mirror[12]["len"]}
        self.assertEqual(self.stats().pages_free, s.pages_free)
        for layer in (0, 1):
            req, qf, kv = self.decode_request(3, layer, [13], True)
            self.check(req, qf, kv, self.stub.Decode(req, timeout=30))
        self.assertEqual(self.stats().pages_free, s.pages_free - 1)
        req, qf, kv = self.decode_request(4, 1, [12, 13], False)
        self.check(req, qf, kv, self.stub.Decode(req, timeout=30))
        for sid in (11, 12, 13):
            self.stub.ReleaseSequence(pb.ReleaseSequenceRequest(sequence_id=sid), timeout=10)
        s = self.stats()
        self.assertEqual((s.pages_free, s.sequences, s.tokens),
                         (before.pages_free, before.sequences, before.tokens))

    def test_decode_stream_keeps_order(self):
        self.create(21)
        for layer in (0, 1):
            self.append(21, layer, 20)
        reqs = [self.decode_request(100 + i, i % 2, [21], False) for i in range(12)]
        bad = pb.DecodeRequest(request_id=999, layer=0, sequence_ids=[21], q=b"\0\0")
        stream_reqs = [r for r, _, _ in reqs[:6]] + [bad] + [r for r, _, _ in reqs[6:]]
        responses = list(self.stub.DecodeStream(iter(stream_reqs), timeout=60))
        self.assertEqual([r.request_id for r in responses], [r.request_id for r in stream_reqs])
        self.assertEqual(responses[6].error_code, grpc.StatusCode.INVALID_ARGUMENT.value[0])
        for (req, qf, kv), resp in zip(reqs, responses[:6] + responses[7:]):
            self.check(req, qf, kv, resp)

    def test_errors_change_nothing(self):
        self.create(31)
        self.append(31, 0, 5)
        self.append(31, 1, 5)
        before = self.stats()
        cases = [
            (lambda: self.stub.CreateSequence(pb.CreateSequenceRequest(sequence_id=31), timeout=10),
             grpc.StatusCode.ALREADY_EXISTS),
            (lambda: self.stub.ReleaseSequence(pb.ReleaseSequenceRequest(sequence_id=404), timeout=10),
             grpc.StatusCode.NOT_FOUND),
            (lambda: self.stub.Decode(pb.DecodeRequest(sequence_ids=[31, 31], q=b"\0" * 2 * 6144),
                                      timeout=10), grpc.StatusCode.INVALID_ARGUMENT),
            (lambda: self.stub.AppendKV(pb.AppendKVRequest(sequence_id=31, layer=1, num_tokens=1,
                                                           k=b"\0" * 1024, v=b"\0" * 1024), timeout=10),
             grpc.StatusCode.FAILED_PRECONDITION),
            (lambda: self.stub.AppendKV(pb.AppendKVRequest(sequence_id=31, layer=0, num_tokens=3000,
                                                           k=b"\0" * 3072000, v=b"\0" * 3072000),
                                        timeout=10), grpc.StatusCode.RESOURCE_EXHAUSTED),
        ]
        for call, code in cases:
            with self.assertRaises(grpc.RpcError) as ctx:
                call()
            self.assertEqual(ctx.exception.code(), code)
        after = self.stats()
        self.assertEqual((after.pages_free, after.sequences, after.tokens),
                         (before.pages_free, before.sequences, before.tokens))


def main():
    global ARGS  # pylint: disable=global-statement
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--stubs", required=True)
    ARGS, rest = parser.parse_known_args()
    unittest.main(argv=[sys.argv[0], "-v", *rest])


if __name__ == "__main__":
    main()
