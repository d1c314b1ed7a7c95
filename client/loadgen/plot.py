#!/usr/bin/env python3
"""Plots a pagedattn-loadgen sweep: latency and throughput against batch size and context length.

    plot.py SWEEP.json [-o OUT.png] [--title TEXT]

Four panels: request latency (p50 solid, p99 dashed, server kernel mean dotted) against batch
size, one line per context length; sequence-decodes per second against batch size; request
latency against context length, one line per batch size; KV read bandwidth (end to end solid,
during kernel time dotted) against context length. Needs matplotlib (the GPU host has it).
"""
import argparse
import json
import math
import sys
from collections import defaultdict


def load_points(path):
    with open(path) as f:
        doc = json.load(f)
    points = doc["points"] if "points" in doc else [doc]
    out = []
    for p in points:
        if "error" in p or "config" not in p:
            continue
        cfg = p["config"]
        rpc = "DecodeStream" if cfg.get("api") == "stream" else "Decode"
        lat = p.get("latency", {}).get(rpc, {})
        kernel = (((p.get("server") or {}).get("metrics") or {}).get("kernel_duration") or {}).get("mean_us")
        out.append({
            "batch": cfg["batch_size"],
            "ctx": cfg.get("lengths", {}).get("context_len") or round(p["run"]["mean_context_tokens"]),
            "p50": lat.get("p50_us"),
            "p99": lat.get("p99_us"),
            "kernel": kernel,
            "seq_per_s": p["throughput"]["sequence_decodes_per_s"],
            "gbps": p["throughput"]["kv_gb_per_s"],
            "kernel_gbps": (p.get("derived") or {}).get("kernel_kv_gb_per_s"),
            "backend": cfg.get("server", {}).get("backend", "?"),
            "callers": cfg.get("concurrency", 1),
            "shape": p.get("shape", "24/4/128, pages of 64, bf16, kv bf16"),  # older results: the default
        })
    return out


def series(points, key, by):
    groups = defaultdict(list)
    for p in points:
        groups[p[by]].append(p)
    for k in groups:
        groups[k].sort(key=lambda p: p[key])
    return dict(sorted(groups.items()))


def finite(v):
    return v is not None and isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def draw(points, out, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    (lat_b, tp_b), (lat_c, bw_c) = axes
    cmap = plt.get_cmap("viridis")

    by_ctx = series(points, "batch", "ctx")
    for i, (ctx, ps) in enumerate(by_ctx.items()):
        color = cmap(i / max(1, len(by_ctx) - 1))
        xs = [p["batch"] for p in ps]
        lat_b.plot(xs, [p["p50"] for p in ps], "o-", color=color, label=f"{ctx} tokens p50")
        lat_b.plot(xs, [p["p99"] for p in ps], "--", color=color, alpha=0.7)
        ks = [(p["batch"], p["kernel"]) for p in ps if finite(p["kernel"])]
        if ks:
            lat_b.plot(*zip(*ks), ":", color=color, alpha=0.9)
        tp_b.plot(xs, [p["seq_per_s"] for p in ps], "o-", color=color, label=f"{ctx} tokens")
    by_batch = series(points, "ctx", "batch")
    for i, (batch, ps) in enumerate(by_batch.items()):
        color = cmap(i / max(1, len(by_batch) - 1))
        xs = [p["ctx"] for p in ps]
        lat_c.plot(xs, [p["p50"] for p in ps], "o-", color=color, label=f"batch {batch} p50")
        lat_c.plot(xs, [p["p99"] for p in ps], "--", color=color, alpha=0.7)
        bw_c.plot(xs, [p["gbps"] for p in ps], "o-", color=color, label=f"batch {batch}")
        ks = [(p["ctx"], p["kernel_gbps"]) for p in ps if finite(p["kernel_gbps"])]
        if ks:
            bw_c.plot(*zip(*ks), ":", color=color, alpha=0.9)

    for ax in axes.flat:
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
    lat_b.set(xlabel="batch size (sequences per Decode)", ylabel="request latency (us)", yscale="log",
              title="latency vs batch (p50 solid, p99 dashed, kernel mean dotted)")
    tp_b.set(xlabel="batch size (sequences per Decode)", ylabel="sequence-decodes / s", yscale="log",
             title="throughput vs batch size")
    lat_c.set(xlabel="context length (tokens)", ylabel="request latency (us)", yscale="log",
              title="latency vs context length (p50 solid, p99 dashed)")
    bw_c.set(xlabel="context length (tokens)", ylabel="KV read (GB/s)",
             title="KV read vs context length (end to end solid, in kernel dotted)")
    for ax in axes.flat:
        ax.legend(fontsize=8)
    backends = sorted({p["backend"] for p in points})
    callers = sorted({p["callers"] for p in points})
    shapes = sorted({p["shape"] for p in points})
    fig.suptitle(title or f"pagedattn-loadgen sweep ({'/'.join(backends)} backend, "
                          f"{'/'.join(map(str, callers))} caller(s); {' | '.join(shapes)})")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", help="JSON written by pagedattn-loadgen --sweep_* --out")
    parser.add_argument("-o", "--out", help="PNG to write (default: SWEEP with .png)")
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    points = load_points(args.sweep)
    if not points:
        print(f"{args.sweep}: no successful points", file=sys.stderr)
        return 1
    out = args.out or (args.sweep[:-5] if args.sweep.endswith(".json") else args.sweep) + ".png"
    draw(points, out, args.title)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
