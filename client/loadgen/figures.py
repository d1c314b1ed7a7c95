#!/usr/bin/env python3
"""The service's reference figures from the JSON results of run_h200.sh, as Markdown tables.

    figures.py OUT_DIR

Reads OUT_DIR/*.json (single runs; sweep.json is skipped) and prints: each run's headline
numbers; the reference figures against their targets. Standard library only.
"""
import glob
import json
import math
import os
import sys


def get(d, *path):
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def fmt(v, spec=".1f"):
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    return format(v, spec)


def main(argv):
    out_dir = argv[1]
    runs = {}
    for path in sorted(glob.glob(os.path.join(out_dir, "*.json"))):
        with open(path) as f:
            doc = json.load(f)
        if doc.get("schema") == "pagedattn-loadgen/1":
            runs[os.path.basename(path)[:-5]] = doc
    if not runs:
        print(f"no results in {out_dir}")
        return 1

    print("| run | backend | B x callers | api | mean ctx | seq-decodes/s | KV GB/s | request p50 / p99 (us) "
          "| server request mean (us) | batch launch->done mean (us) | kernel mean (us) | queue mean (us) | batch mean | check |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        api = get(r, "config", "api")
        rpc = "DecodeStream" if api == "stream" else "Decode"
        check = get(r, "check")
        check_txt = "off"
        if check and check.get("enabled"):
            check_txt = ("PASS" if check.get("passed") else "FAIL") + \
                f" ({check.get('decodes_checked')}; L2 {fmt(check.get('max_output_rel_l2'), '.2e')}, " \
                f"lse {fmt(check.get('max_lse_abs_err'), '.1e')})"
        print(f"| {name} | {get(r, 'config', 'server', 'backend')} | {get(r, 'config', 'batch_size')} x "
              f"{get(r, 'config', 'concurrency')} | {api} | {fmt(get(r, 'run', 'mean_context_tokens'), '.0f')} | "
              f"{fmt(get(r, 'throughput', 'sequence_decodes_per_s'), '.0f')} | "
              f"{fmt(get(r, 'throughput', 'kv_gb_per_s'), '.1f')} | "
              f"{fmt(get(r, 'latency', rpc, 'p50_us'))} / {fmt(get(r, 'latency', rpc, 'p99_us'))} | "
              f"{fmt(get(r, 'server', 'metrics', 'request_duration', rpc, 'mean_us'))} | "
              f"{fmt(get(r, 'derived', 'batch_duration_mean_us'))} | "
              f"{fmt(get(r, 'derived', 'kernel_mean_us'))} | "
              f"{fmt(get(r, 'server', 'metrics', 'queue_duration', 'mean_us'))} | "
              f"{fmt(get(r, 'server', 'metrics', 'batch_size', 'mean'))} | {check_txt} |")

    print()
    print("| figure | run | measured | target | met |")
    print("|---|---|---|---|---|")

    def row(figure, name, value, target, ok, spec=".2f"):
        met = "n/a" if value is None else ("yes" if ok(value) else "NO")
        print(f"| {figure} | {name} | {fmt(value, spec)} | {target} | {met} |")

    for name, r in runs.items():
        if get(r, "check", "enabled"):
            passed = get(r, "check", "passed")
            print(f"| correctness: sampled decodes vs CPU reference | {name} | "
                  f"max rel L2 {fmt(get(r, 'check', 'max_output_rel_l2'), '.2e')}, "
                  f"max lse err {fmt(get(r, 'check', 'max_lse_abs_err'), '.1e')} | "
                  f"rel L2 < 1e-2, lse < 1e-3 | {'yes' if passed else 'NO'} |")
    for name in ("a_b64_ctx4096_c1", "a_b64_ctx4096_c1_attend"):
        if name in runs:
            d = runs[name]["derived"]
            row("(a) request mean / kernel mean, B=64 x 4096", name, d.get("request_mean_over_kernel_mean"),
                "<= 1.3", lambda v: v <= 1.3)
            row("(a) server-side request mean / kernel mean", name, d.get("server_request_mean_over_kernel_mean"),
                "<= 1.3", lambda v: v <= 1.3)
            row("(a) batch launch->done mean / kernel mean (server step, no RPC)", name,
                d.get("batch_duration_mean_over_kernel_mean"), "<= 1.3", lambda v: v <= 1.3)
    for name in ("a_b64_ctx4096_c1", "a_b64_ctx4096_c1_attend", "a_b64_ctx4096_c4", "a_b64_ctx4096_c4_stream",
                 "a_b64_ctx4096_c8"):
        if name in runs:
            row("(a) throughput / kernel alone", name, runs[name]["derived"].get("throughput_over_kernel_alone"),
                ">= 0.70", lambda v: v >= 0.70)
    for name in ("b_b1_ctx512_c1", "b_b1_ctx512_c1_attend"):
        if name in runs:
            d = runs[name]["derived"]
            row("(b) request p50 - kernel mean (us), B=1 x 512", name,
                d.get("request_p50_minus_kernel_mean_us"), "< 100", lambda v: v < 100, ".1f")
            row("(b) request p50 - kernel mean - client RPC floor p50 (us)", name,
                d.get("request_p50_minus_kernel_mean_minus_rpc_floor_us"), "< 100", lambda v: v < 100, ".1f")
            row("(b) server-side request mean - kernel mean (us)", name,
                d.get("server_request_mean_minus_kernel_mean_us"), "< 100", lambda v: v < 100, ".1f")

    stages = ("to_work", "receive", "prepare", "launch", "launch_plan", "launch_pack", "device_in", "wait",
              "wait_unpack", "device_out", "callbacks", "release")
    if any(get(r, "server", "metrics", "stage_duration") for r in runs.values()):
        print()
        print("| run | " + " | ".join(f"{st} mean (us)" for st in stages) + " |")
        print("|---|" + "---|" * len(stages))
        for name, r in runs.items():
            cells = [fmt(get(r, "server", "metrics", "stage_duration", st, "mean_us")) for st in stages]
            print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
