#!/usr/bin/env python3
"""The user's alternative in plain PyTorch, timed like pagedattn-kernel-bench.

Per workload: random normal bf16 q and caches; the padded page table and mask are built once
(the analogue of the kernel's plan); each timed step gathers the pages of every sequence
(k_cache[table], v_cache[table]) and calls torch.nn.functional.scaled_dot_product_attention
with enable_gqa=True and a padding mask. The L2 is flushed as in the kernel bench (a 256 MiB write, then a read of it, so the step starts
with a clean L2); CUDA events bracket the step; the median over --iters steps is reported. One JSON object a
workload goes to --out.
"""
import argparse
import json
import math
import statistics

import torch
import torch.nn.functional as F


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def short(name):
    p = name.rfind("_p")
    return name[:p] if p >= 0 else name


def bench(w, iters, flush):
    dev = "cuda"
    b, pages = w["batch_size"], w["num_pages"]
    q = torch.randn(b, 24, 1, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(pages, 64, 4, 128, device=dev, dtype=torch.bfloat16)
    v = torch.randn(pages, 64, 4, 128, device=dev, dtype=torch.bfloat16)
    indptr = torch.tensor(w["kv_indptr"], device=dev, dtype=torch.int64)
    indices = torch.tensor(w["kv_indices"], device=dev, dtype=torch.int64)
    last = torch.tensor(w["kv_last_page_len"], device=dev, dtype=torch.int64)
    n = indptr[1:] - indptr[:-1]
    max_pages = int(n.max())
    ar = torch.arange(max_pages, device=dev)
    valid_page = ar[None, :] < n[:, None]
    pos = (indptr[:-1, None] + ar[None, :]).clamp(max=max(indices.numel() - 1, 0))
    table = torch.where(valid_page, indices[pos], torch.zeros_like(pos))
    lens = torch.where(n > 0, (n - 1) * 64 + last, torch.zeros_like(n))
    mask = (torch.arange(max_pages * 64, device=dev)[None, :] < lens[:, None])[:, None, None, :]
    scale = 1.0 / math.sqrt(128)

    def step():
        kk = k[table].reshape(b, max_pages * 64, 4, 128).transpose(1, 2)
        vv = v[table].reshape(b, max_pages * 64, 4, 128).transpose(1, 2)
        return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=scale,
                                              enable_gqa=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        flush.fill_(i & 0xFF)  # evict the workload from L2 ...
        flush.max()            # ... and leave it clean (same method as the kernel bench)
        starts[i].record()
        step()
        ends[i].record()
    torch.cuda.synchronize()
    us = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
    del k, v
    torch.cuda.empty_cache()
    return statistics.median(us)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads",
                    default="kernels/bench/workloads/gqa_paged_decode_h24_kv4_d128_ps64.jsonl")
    ap.add_argument("--out", default="torch_baseline.jsonl")
    ap.add_argument("--iters", type=int, default=100)
    args = ap.parse_args()
    flush = torch.empty(256 << 20, device="cuda", dtype=torch.uint8)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    with open(args.out, "w") as out:
        for w in load(args.workloads):
            us = bench(w, args.iters, flush)
            print(f"torch {short(w['name']):<16} {us:10.1f} us", flush=True)
            out.write(json.dumps({"name": short(w["name"]), "torch_us": round(us, 2),
                                  "iters": args.iters}) + "\n")


if __name__ == "__main__":
    main()
