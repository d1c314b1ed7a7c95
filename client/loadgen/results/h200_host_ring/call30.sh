#!/bin/bash
# Device call 30 (2026-12-04): the kernel's GPU test of PlanInto (and the misuse and graph
# tests); an A/B interleaved twice of fewer calls before the attention (pagedattn-server, commit
# 5667255: the plan inside the arena's copy, no wait on a finished previous batch) against call
# 29's binary (pagedattn-server-call29, commit a5a2be7); then the full figures run
# (server/backend/device_e2e.sh: the CUDA backend's GPU tests, the server, run_h200.sh) with the
# new binary: client/loadgen/results/h200/. (Run then as a script of its own; this is the same
# run through client/loadgen/ab_h200.sh. JSON: call30/ring/.)
set -u
B=$PWD/.device/bundle
LD_LIBRARY_PATH=$B/lib timeout 120 $B/bin/pagedattn_kernel_gpu_test \
  --gtest_filter='*PlanInto*:*ReportsMisuse*:*CapturedInACudaGraph*' > $OUT/kernel_tests.log 2>&1
echo "kernel gpu test (PlanInto, misuse, graph) rc=$?"
client/loadgen/ab_h200.sh call29=pagedattn-server-call29 fewer=pagedattn-server
mkdir -p $OUT/e2e
OUT=$OUT/e2e SERVER_FLAGS="--num_layers=1 --max_batch_size=64 --max_queue_delay_us=0 --num_pages=200000" \
  LOADGEN_TIMEOUT=330 TEST_TIMEOUT=150 timeout 450 server/backend/device_e2e.sh .device/bundle > /dev/null 2>&1
echo "e2e rc=$?"
cp $OUT/e2e/e2e.log $OUT/e2e/figures.md $OUT/ 2>/dev/null
tar -czf $OUT/e2e.tar.gz -C $OUT e2e && rm -rf $OUT/e2e
grep -E "^ok|^FAIL" $OUT/e2e.log
