#!/bin/bash
# Device call 34 (2026-12-04): the CUDA backend's GPU tests, then an A/B interleaved twice of the
# plan on the helper thread (default) against the plan in line (--cuda_plan_thread=false), one
# binary (commit f55051c, bundle of server/backend/make_device_bundle.sh build .device/bundle).
# Output: call34_tests.log, call34_ab.log, call34_ab.tar.gz (every run's JSON, server logs).
export LD_LIBRARY_PATH=$PWD/.device/bundle/lib
B=.device/bundle/bin
mkdir -p $OUT/t
(timeout 300 $B/pagedattn_cuda_backend_test --gtest_brief=1; echo "backend rc=$?"
 timeout 120 $B/pagedattn_cuda_staging_test --gtest_brief=1; echo "staging rc=$?") > $OUT/t/tests.log 2>&1
OUT=/tmp/ab ROUNDS=2 client/loadgen/ab_h200.sh helper=pagedattn-server \
  inline=pagedattn-server,--cuda_plan_thread=false > /dev/null 2>&1
cp /tmp/ab/ab.log /tmp/ab/ab.tar.gz $OUT/t/
