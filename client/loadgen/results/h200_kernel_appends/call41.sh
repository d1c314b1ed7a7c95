#!/bin/bash
# Device call 41 (2026-12-04): compute-sanitizer memcheck and racecheck on the kernel's append
# test (all 8 decoder configurations write the newest token before reading its page) and on
# the CUDA backend's steps written by the kernel. Output: call41_sanitizer_*.log.
export LD_LIBRARY_PATH=$PWD/.device/bundle/lib
B=.device/bundle/bin
for tool in memcheck racecheck; do
  timeout 240 compute-sanitizer --tool $tool --error-exitcode 9 $B/pagedattn_kernel_gpu_test \
    --gtest_filter='*AppendsTheNewestToken*' > $OUT/call41_sanitizer_$tool.log 2>&1
  echo "kernel append test under $tool rc=$?" | tee -a $OUT/call41_sanitizer_$tool.log
done
timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 $B/pagedattn_cuda_backend_test \
  --gtest_filter='*DecodeStepsWrittenByTheKernel*:*ABadPageInABatchCopiedFromTheRing*' \
  > $OUT/call41_sanitizer_backend_memcheck.log 2>&1
echo "backend steps under memcheck rc=$?" | tee -a $OUT/call41_sanitizer_backend_memcheck.log
