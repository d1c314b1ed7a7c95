#!/usr/bin/env python3
"""Merges pagedattn-kernel-bench and torch_baseline.py output with the FlashInfer bar into one
JSON object a workload, and prints a markdown table."""
import argparse
import json
import math

# The bar: FlashInfer 0.6.17's batch decode timed on an H200, the better of its two paths (us).
FLASHINFER_US = {
    "b2_kv130": 19.9, "b4_kv247": 24.5, "b4_kv275": 26.1, "b1_kv361": 29.7, "b8_kv471": 33.5,
    "b8_kv527": 35.6, "b1_kv882": 48.2, "b16_kv993": 51.7, "b32_kv1954": 81.5,
    "b32_kv2178": 87.3, "b8_kv3176": 116.3, "b64_kv3939": 231.9, "b64_kv4387": 215.9,
    "b4_kv4583": 157.0, "b16_kv6068": 200.3, "b128_kv7865": 355.1, "b8_kv7941": 257.2,
    "b128_kv8761": 384.1, "b32_kv12162": 386.6, "b16_kv16593": 510.5,
}


def read(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", required=True)
    ap.add_argument("--torch", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    bench = read(args.bench)
    torch_us = {r["name"]: r["torch_us"] for r in read(args.torch)}
    rows, extra = [], {}
    for r in bench:
        if r["name"] not in FLASHINFER_US:
            extra[r["name"]] = r
            continue
        r = dict(r)
        r["flashinfer_us"] = FLASHINFER_US[r["name"]]
        r["torch_us"] = torch_us.get(r["name"])
        r["speedup_vs_flashinfer"] = round(r["flashinfer_us"] / r["kernel_us"], 3)
        r["speedup_vs_flashinfer_dirty_flush"] = round(r["flashinfer_us"] / r["kernel_dirty_us"], 3)
        if r["torch_us"]:
            r["speedup_vs_torch"] = round(r["torch_us"] / r["kernel_us"], 2)
        floor = r.get("stream_floor_us") or 0
        if floor > 0:
            # What no kernel that reads these bytes can beat: the bar over the floor, and the
            # floor's own read rate as a fraction of the 4 GiB stream read.
            r["ceiling_vs_flashinfer"] = round(r["flashinfer_us"] / floor, 3)
            r["floor_read_fraction"] = round(r["kv_bytes"] / floor / 1e3 / r["stream_read_gbps"], 4)
            if r["torch_us"]:
                r["ceiling_vs_torch"] = round(r["torch_us"] / floor, 2)
        rows.append(r)
    with open(args.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        for name, r in extra.items():
            f.write(json.dumps(r) + "\n")
    print("| workload | kernel µs | FlashInfer µs | vs FlashInfer | torch µs | vs torch | "
          "read GB/s | of stream read | dirty-flush µs | vs FI (dirty) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['kernel_us']:.1f} | {r['flashinfer_us']:.1f} | "
              f"{r['speedup_vs_flashinfer']:.2f}x | {r.get('torch_us') or float('nan'):.0f} | "
              f"{r.get('speedup_vs_torch', float('nan')):.1f}x | {r['read_gbps']:.0f} | "
              f"{r['read_fraction']:.3f} | {r['kernel_dirty_us']:.1f} | "
              f"{r['speedup_vs_flashinfer_dirty_flush']:.2f}x |")
    geo = math.exp(sum(math.log(r["speedup_vs_flashinfer"]) for r in rows) / max(len(rows), 1))
    geo_d = math.exp(sum(math.log(r["speedup_vs_flashinfer_dirty_flush"]) for r in rows) /
                     max(len(rows), 1))
    print(f"\ngeomean speedup vs FlashInfer: {geo:.3f}x over {len(rows)} workloads "
          f"(not faster on {sum(r['speedup_vs_flashinfer'] <= 1 for r in rows)}); "
          f"with the dirty flush {geo_d:.3f}x "
          f"(not faster on {sum(r['speedup_vs_flashinfer_dirty_flush'] <= 1 for r in rows)})")
    big = [r for r in rows if r["num_kv_indices"] >= 3000]
    if big:
        print(f"min read fraction on >= 3000 pages: {min(r['read_fraction'] for r in big):.3f} "
              f"(dirty flush {min(r['read_fraction_dirty'] for r in big):.3f})")
    ts = [r["speedup_vs_torch"] for r in rows if "speedup_vs_torch" in r]
    if ts:
        print(f"min speedup vs torch: {min(ts):.1f}x")
    if "uneven_1x4000_300x16" in extra and "uniform_275x32" in extra:
        u, v = extra["uneven_1x4000_300x16"], extra["uniform_275x32"]
        print(f"uneven {u['kernel_us']:.1f} us vs uniform {v['kernel_us']:.1f} us: "
              f"ratio {u['kernel_us'] / v['kernel_us']:.3f}")
    if all("ceiling_vs_flashinfer" in r for r in rows) and rows:
        ceil = math.exp(sum(math.log(r["ceiling_vs_flashinfer"]) for r in rows) / len(rows))
        print(f"\nfloors (a contiguous streaming read of each workload's bytes, timed the same way):")
        print("| workload | floor µs | kernel / floor | bar / floor | floor of stream read | "
              "PyTorch / floor |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['name']} | {r['stream_floor_us']:.1f} | "
                  f"{r['kernel_us'] / r['stream_floor_us']:.2f} | {r['ceiling_vs_flashinfer']:.2f}x | "
                  f"{r['floor_read_fraction']:.3f} | {r.get('ceiling_vs_torch', float('nan')):.1f}x |")
        print(f"ceiling of the geomean vs FlashInfer (every workload at its floor): {ceil:.3f}x")
        print("workloads >= 3000 pages whose floor reads under 90% of the stream read: " +
              ", ".join(r["name"] for r in big if r["floor_read_fraction"] < 0.9))
        print("workloads whose floor is over a fifth of PyTorch's time: " +
              ", ".join(r["name"] for r in rows if r.get("ceiling_vs_torch", 99) < 5))
    b1 = [r for r in rows if r["name"] == "b1_kv361"]
    if b1:
        print(f"b1_kv361: {b1[0]['kernel_us']:.1f} us (dirty flush {b1[0]['kernel_dirty_us']:.1f})")
    print(f"stream read: {bench[0]['stream_read_gbps']:.0f} GB/s; load path {bench[0]['load_path']}")


if __name__ == "__main__":
    main()
