#!/bin/bash
# Device call 38 (2026-12-04): the CUDA backend's GPU tests, then an A/B interleaved twice of
#   new      this tree: kernel appends, the row copies issued before the page-id check and the
#            output runs, the begin event in one batch of 8;
#   c37      call 37's binary (kernel appends, the old order, begin on every batch), kept in the
#            bundle as pagedattn-server-c37;
#   scatter  this tree with --cuda_kernel_appends=false.
# Output: call38_tests.log, call38_ab.log, call38_ab.tar.gz.
export LD_LIBRARY_PATH=$PWD/.device/bundle/lib
B=.device/bundle/bin
(timeout 200 $B/pagedattn_cuda_backend_test --gtest_brief=1; echo "cuda backend test rc=$?"
 timeout 60 $B/pagedattn_cuda_staging_test --gtest_brief=1; echo "staging test rc=$?") \
  > $OUT/call38_tests.log 2>&1
OUT=/tmp/ab ROUNDS=2 client/loadgen/ab_h200.sh new=pagedattn-server c37=pagedattn-server-c37 \
  scatter=pagedattn-server,--cuda_kernel_appends=false > /dev/null 2>&1
cp /tmp/ab/ab.log $OUT/call38_ab.log
cp /tmp/ab/ab.tar.gz $OUT/call38_ab.tar.gz
