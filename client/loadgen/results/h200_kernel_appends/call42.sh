#!/bin/bash
# Device call 42 (2026-12-04): the GPU tests of the CUDA backend and the engine on it, for the
# commit that stops packing token slots for a round whose tokens the kernel writes, and one
# A/B round of it (new) against --cuda_kernel_appends=false (scatter).
# Output: call42_tests.log, call42_ab.log.
export LD_LIBRARY_PATH=$PWD/.device/bundle/lib
B=.device/bundle/bin
(timeout 200 $B/pagedattn_cuda_backend_test --gtest_brief=1; echo "cuda backend test rc=$?"
 timeout 60 $B/pagedattn_cuda_staging_test --gtest_brief=1; echo "staging test rc=$?") \
  > $OUT/call42_tests.log 2>&1
OUT=/tmp/ab ROUNDS=1 client/loadgen/ab_h200.sh new=pagedattn-server \
  scatter=pagedattn-server,--cuda_kernel_appends=false > /dev/null 2>&1
cp /tmp/ab/ab.log $OUT/call42_ab.log
