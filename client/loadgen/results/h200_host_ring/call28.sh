#!/bin/bash
# Device call 28 (2026-12-04): the CUDA backend's GPU tests, then an A/B/C interleaved twice:
# ring0 (--cuda_host_ring_mib=0: every batch packed and unpacked by the host, as before the
# ring), copy (the ring, outputs copied back into the blocks: --cuda_kernel_writes_outputs=false)
# and kw (the defaults: the ring, and a one-request batch's outputs written by the kernel into
# its block). Adds the launch_plan stage to the breakdown. (Run then as a script of its own;
# this is the same run through client/loadgen/ab_h200.sh. JSON: call28/ring/.)
set -u
B=$PWD/.device/bundle
for t in pagedattn_cuda_staging_test pagedattn_cuda_backend_test; do
  LD_LIBRARY_PATH=$B/lib timeout 200 $B/bin/$t --gtest_brief=1 >> $OUT/tests.log 2>&1
  echo "$t rc=$?"
done
client/loadgen/ab_h200.sh ring0=pagedattn-server,--cuda_host_ring_mib=0 \
  copy=pagedattn-server,--cuda_kernel_writes_outputs=false kw=pagedattn-server
