#!/bin/bash
# Device call 40 (2026-12-04), commit of the kernel built with and without appends:
# 1. the kernel benchmark of a564b3c's kernel (.device/kbench/old) against this one
#    (.device/kbench/new) on the 20 workloads, TMA path, interleaved twice (call40_bench.tar.gz);
# 2. the full figures run (the GPU tests of the kernel, the CUDA backend and the engine on it,
#    the server, a CLI round trip, client/loadgen/run_h200.sh): client/loadgen/results/h200/.
export PAGEDATTN_WORKLOADS=$PWD/kernels/bench/workloads/gqa_paged_decode_h24_kv4_d128_ps64.jsonl
K=.device/kbench
W=/tmp/call40
mkdir -p $W
for r in 1 2; do
  for v in old new; do
    timeout 90 $K/$v --out $W/bench_${v}_$r.jsonl --no-uneven --no-cpasync --no-floors \
      > $W/bench_${v}_$r.log 2>&1
    echo "bench $v round $r rc=$?" >> $W/rc.log
  done
done
tar -C /tmp -czf $OUT/call40_bench.tar.gz call40
KERNEL_TESTS=1 SERVER_FLAGS="--num_layers=1 --max_batch_size=64 --max_queue_delay_us=0 --num_pages=200000" \
  server/backend/device_e2e.sh .device/bundle
rm -f $OUT/smoke.json  # at most 8 files come back from a device call
