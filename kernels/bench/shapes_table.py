#!/usr/bin/env python3
"""Merges `pagedattn-kernel-bench --shape` results (shape_<shape>_<kv>.jsonl) with FlashInfer's
(fi_<shape>_<kv>.csv, the better of its two paths per workload) from one output folder into a
Markdown table per shape and page type, with the geomeans the targets name:
  FlashInfer / pagedattn (> 1: this kernel faster), time / floor, and for fp8 pages the time
  over this kernel's own bf16 time on workloads of 3,000 pages and more.
Usage: shapes_table.py OUT_DIR"""
import csv
import glob
import json
import math
import os
import sys


def geomean(xs):
    xs = [x for x in xs if x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def load_ours(path):
    with open(path) as f:
        return {r["name"]: r for r in (json.loads(line) for line in f if line.strip())}


def load_fi(path):
    best = {}
    if not os.path.exists(path):
        return best
    with open(path) as f:
        for row in csv.DictReader(f):
            name = row["name"].split("/")[-1].split("_p")[0]
            us = float(row["run_us_median"])
            if name not in best or us < best[name]:
                best[name] = us
    return best


def main():
    out = sys.argv[1]
    runs = sorted(glob.glob(os.path.join(out, "shape_*.jsonl")))
    ours_by_tag = {os.path.basename(p)[6:-6]: load_ours(p) for p in runs}
    for tag, ours in ours_by_tag.items():
        fi = load_fi(os.path.join(out, f"fi_{tag}.csv"))
        shape = tag.rsplit("_", 2)[0] if tag.endswith("fp8_e4m3") else tag.rsplit("_", 1)[0]
        bf16 = ours_by_tag.get(f"{shape}_auto", {})
        print(f"\n### {tag}\n")
        print("| workload | batch | pages | µs | floor µs | x floor | FlashInfer µs | FI / ours |"
              + (" / own bf16 |" if tag.endswith("fp8_e4m3") else ""))
        print("|---|---|---|---|---|---|---|---|" + ("---|" if tag.endswith("fp8_e4m3") else ""))
        vs_fi, vs_floor, vs_bf16, short_floor = [], [], [], []
        for name, r in ours.items():
            f = fi.get(name)
            ratio = f / r["us"] if f else None
            row = (f"| {name} | {r['batch']} | {r['pages']} | {r['us']:.1f} | {r['floor_us']:.1f} | "
                   f"{r['us'] / r['floor_us']:.2f} | {f'{f:.1f}' if f else '-'} | "
                   f"{f'{ratio:.2f}' if ratio else '-'} |")
            if name.startswith("short_"):
                short_floor.append(r["us"] / r["floor_us"])
            else:
                vs_floor.append(r["us"] / r["floor_us"])
                if ratio:
                    vs_fi.append(ratio)
            if tag.endswith("fp8_e4m3"):
                own = bf16.get(name)
                rel = r["us"] / own["us"] if own else None
                row += f" {f'{rel:.2f}' if rel else '-'} |"
                if rel and own["pages"] >= 3000 and not name.startswith("short_"):
                    vs_bf16.append(rel)
            print(row)
        print(f"\ngeomean FI / ours {geomean(vs_fi):.3f} over {len(vs_fi)} "
              f"(slower than FI on {sum(1 for x in vs_fi if x < 1)}); time / floor "
              f"{geomean(vs_floor):.3f}; short batches / floor {geomean(short_floor):.3f}"
              + (f"; fp8 / own bf16 on >= 3,000 pages {geomean(vs_bf16):.3f} over {len(vs_bf16)}"
                 if tag.endswith("fp8_e4m3") else ""))


if __name__ == "__main__":
    main()
