#!/usr/bin/env python3
"""The table of client/loadgen/run_tensors_h200.sh: each run's client p50 against the kernel's
mean time and the bare gRPC round trip measured in the same run, and the throughput of the
streaming runs against what the kernel alone sustains.

usage: tensors_table.py OUT_DIR   (reads OUT_DIR/*.json written by pagedattn-loadgen)
"""
import glob
import json
import os
import sys


def load(path):
    with open(path) as f:
        return json.load(f)


def main(out):
    rows = []
    for path in sorted(glob.glob(os.path.join(out, "*.json"))):
        d = load(path)
        name = os.path.splitext(os.path.basename(path))[0]
        lat = d.get("latency", {})
        key = "Decode" if "Decode" in lat else "DecodeStream"
        kernel = d.get("server", {}).get("metrics", {}).get("kernel_duration", {}).get("mean_us", 0.0)
        floor = lat.get("rpc_floor", {}).get("p50_us", 0.0)
        p50 = lat.get(key, {}).get("p50_us", 0.0)
        batch = d.get("config", {}).get("batch_size", 0)
        throughput = d.get("throughput", {}).get("sequence_decodes_per_s", 0.0)
        alone = batch * 1e6 / kernel if kernel else 0.0
        check = d.get("check", {})
        verdict = "-" if not check.get("enabled") else ("pass" if check.get("passed") else "FAIL")
        rows.append((name, p50, kernel, floor, p50 - kernel - floor, throughput, alone, verdict))
    print("| run | client p50 µs | kernel mean µs | bare round trip p50 µs | p50 - kernel - round trip µs "
          "| seq-decodes/s | of the kernel alone | check |")
    print("|---|---|---|---|---|---|---|---|")
    for name, p50, kernel, floor, extra, tput, alone, check in rows:
        share = f"{tput / alone:.2f}" if alone else "-"
        print(f"| {name} | {p50:.1f} | {kernel:.1f} | {floor:.1f} | {extra:.1f} | {tput:,.0f} | {share} | {check} |")


if __name__ == "__main__":
    main(sys.argv[1])
