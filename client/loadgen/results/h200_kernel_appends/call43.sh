#!/bin/bash
# Device call 43 (2026-12-04): the GPU tests of the CUDA backend and the engine on it, and the
# kernel's, for the commit whose refused batch waits for its copies on an event with the
# backend's timeout (was cudaStreamSynchronize). Output: call43_tests.log.
export LD_LIBRARY_PATH=$PWD/.device/bundle/lib
B=.device/bundle/bin
(timeout 200 $B/pagedattn_cuda_backend_test --gtest_brief=1; echo "cuda backend test rc=$?"
 timeout 60 $B/pagedattn_cuda_staging_test --gtest_brief=1; echo "staging test rc=$?"
 timeout 300 $B/pagedattn_kernel_gpu_test --gtest_brief=1; echo "kernel gpu test rc=$?") \
  > $OUT/call43_tests.log 2>&1
