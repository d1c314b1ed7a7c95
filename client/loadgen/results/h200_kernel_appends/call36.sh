#!/bin/bash
# Device call 36 (2026-12-04): decode steps whose new tokens the decode kernel writes itself.
# The GPU tests (the kernel's, with the new append test; the CUDA backend's and the engine's on
# it), then the kernel benchmark of the previous kernel (a564b3c, .device/kbench/old) against
# this one (.device/kbench/new) on the 20 workloads, TMA path, interleaved twice: the kernel
# without appends must not have moved. Output: call36_tests.log, call36_bench.tar.gz.
export LD_LIBRARY_PATH=$PWD/.device/bundle/lib
export PAGEDATTN_WORKLOADS=$PWD/kernels/bench/workloads/gqa_paged_decode_h24_kv4_d128_ps64.jsonl
B=.device/bundle/bin
K=.device/kbench
W=/tmp/call36
mkdir -p $W
(timeout 300 $B/pagedattn_kernel_gpu_test --gtest_brief=1; echo "kernel gpu test rc=$?"
 timeout 200 $B/pagedattn_cuda_backend_test --gtest_brief=1; echo "cuda backend test rc=$?"
 timeout 60 $B/pagedattn_cuda_staging_test --gtest_brief=1; echo "staging test rc=$?") \
  > $OUT/call36_tests.log 2>&1
for r in 1 2; do
  for v in old new; do
    timeout 90 $K/$v --out $W/bench_${v}_$r.jsonl --no-uneven --no-cpasync --no-floors \
      > $W/bench_${v}_$r.log 2>&1
    echo "bench $v round $r rc=$?" >> $OUT/call36_tests.log
  done
done
tar -C /tmp -czf $OUT/call36_bench.tar.gz call36
