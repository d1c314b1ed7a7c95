"""Asserts on a pagedattn-loadgen JSON result (or sweep): used by the integration test.

check_result.py FILE [--sweep N] [--no-check] [--no-metrics] [--api unary|stream] [--transport grpc|local]
                [--shape DESCRIPTION]
--shape: the server's shape as kernels::DescribeShape writes it (default: the default shape).
Exit 0 when every assertion holds, 1 with the failed ones listed otherwise. Standard library only.
"""
import json
import math
import re
import sys

DEFAULT_SHAPE = "24/4/128, pages of 64, bf16, kv bf16"
ELEM_BYTES = {"bf16": 2, "fp16": 2, "fp8_e4m3": 1}


def check_point(r, failures, where, want_check, want_metrics, api, transport="grpc", shape=DEFAULT_SHAPE):
    def expect(cond, what):
        if not cond:
            failures.append(f"{where}: {what}")

    expect(r.get("schema") == "pagedattn-loadgen/1", "schema")
    # The shape named, and its fields agreeing with the description.
    expect(r.get("shape") == shape, f"shape {r.get('shape')!r}, expected {shape!r}")
    s = r.get("config", {}).get("server", {}).get("shape", {})
    m = re.fullmatch(r"(\d+)/(\d+)/(\d+), pages of (\d+), (\w+), kv (\w+)", shape)
    expect(m is not None and s.get("description") == shape and
           [s.get(f) for f in ("num_qo_heads", "num_kv_heads", "head_dim", "page_size")] ==
           [int(m.group(i)) for i in range(1, 5)] and
           (s.get("dtype"), s.get("kv_cache_dtype")) == (m.group(5), m.group(6)),
           f"config.server.shape {s} matches {shape!r}")
    if m and m.group(6) == "fp8_e4m3" and want_check:
        layers = r.get("config", {}).get("num_layers", 0)
        expect(len(s.get("k_scales", [])) == layers and len(s.get("v_scales", [])) == layers,
               "fp8 pages: the server's scales, one per layer")
    # What one token of one layer holds in the pages, K and V.
    kv_token_bytes = 2 * int(m.group(2)) * int(m.group(3)) * ELEM_BYTES.get(m.group(6), 0) if m else 0
    tp = r.get("throughput", {})
    expect(tp.get("sequence_decodes_per_s", 0) > 0, "sequence_decodes_per_s > 0")
    expect(tp.get("kv_gb_per_s", 0) > 0, "kv_gb_per_s > 0")
    run = r.get("run", {})
    expect(run.get("sequence_decodes", 0) > 0, "sequence_decodes > 0")
    expect(run.get("errors") == {}, f"no errors (got {run.get('errors')})")
    expect(run.get("retired_batches") == [], "no retired batches")
    # KV bytes: tokens attended x num_kv_heads x head_dim x the pages' element bytes x 2 (K and V).
    expect(kv_token_bytes > 0 and
           math.isclose(run.get("kv_bytes_read", 0),
                        run.get("mean_context_tokens", 0) * run.get("sequence_decodes", 0) * kv_token_bytes,
                        rel_tol=1e-6), f"kv_bytes_read = tokens x {kv_token_bytes}")
    rpc = "DecodeStream" if api == "stream" else "Decode"
    lat = r.get("latency", {}).get(rpc)
    expect(lat is not None, f"latency of {rpc}")
    if lat:
        expect(0 < lat["min_us"] <= lat["p50_us"] <= lat["p90_us"] <= lat["p99_us"] <= lat["max_us"],
               f"{rpc} latency ordered and positive: {lat}")
        expect(lat["p99_us"] < 10e6, f"{rpc} p99 under 10 s")
    for kind in ("AppendKV", "CreateSequence", "ReleaseSequence", "step"):
        expect(r.get("latency", {}).get(kind, {}).get("count", 0) > 0, f"latency of {kind}")
    srv = r.get("server", {})
    expect(srv.get("stats_delta", {}).get("decoded_sequences", 0) >= run.get("sequence_decodes", 1),
           "the server decoded at least what the client counted")
    if want_metrics:
        m = srv.get("metrics") or {}
        expect("error" not in m, f"metrics read ({m.get('error')})")
        expect(m.get("kernel_duration", {}).get("count", 0) > 0, "kernel_duration count > 0")
        expect(m.get("kernel_duration", {}).get("mean_us", 0) > 0, "kernel_duration mean > 0")
        expect(m.get("queue_duration", {}).get("count", 0) > 0, "queue_duration count > 0")
        expect(m.get("batch_size", {}).get("mean", 0) >= 1, "batch_size mean >= 1")
        expect(rpc in m.get("request_duration", {}), f"server request_duration of {rpc}")
        d = r.get("derived", {})
        expect((d.get("kernel_alone_sequence_decodes_per_s") or 0) > 0, "kernel-alone throughput")
    expect(r.get("config", {}).get("transport") == transport, f"config.transport {transport}")
    if want_metrics:
        totals = (srv.get("metrics") or {}).get("requests_total", {})
        ok = f'{{code="OK",method="{rpc}",transport="{transport}"}}'
        expect(totals.get(ok, 0) > 0, f"server counted the decodes as {ok} ({totals})")
    if want_check:
        c = r.get("check", {})
        expect(c.get("enabled") is True, "check enabled")
        expect(c.get("passed") is True, f"check passed ({c})")
        expect(c.get("decodes_checked", 0) > 0, "decodes checked")


def main(argv):
    path = argv[1]
    sweep = int(argv[argv.index("--sweep") + 1]) if "--sweep" in argv else 0
    api = argv[argv.index("--api") + 1] if "--api" in argv else "unary"
    want_check = "--no-check" not in argv
    want_metrics = "--no-metrics" not in argv
    transport = argv[argv.index("--transport") + 1] if "--transport" in argv else "grpc"
    shape = argv[argv.index("--shape") + 1] if "--shape" in argv else DEFAULT_SHAPE
    with open(path) as f:
        doc = json.load(f)
    failures = []
    if sweep:
        if doc.get("schema") != "pagedattn-loadgen-sweep/1":
            failures.append("sweep schema")
        if doc.get("shape") != shape:
            failures.append(f"sweep shape {doc.get('shape')!r}, expected {shape!r}")
        points = doc.get("points", [])
        if len(points) != sweep:
            failures.append(f"{len(points)} sweep points, expected {sweep}")
        for i, p in enumerate(points):
            check_point(p, failures, f"{path} point {i}", want_check, want_metrics, api, shape=shape)
    else:
        check_point(doc, failures, path, want_check, want_metrics, api, transport, shape)
    for line in failures:
        print("FAIL", line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
