#!/bin/bash
# Device call 27 (2026-12-04): the CUDA backend's GPU tests with the host ring, then an A/B of
# the ring (--cuda_host_ring_mib=128, the default then: Decodes received into pinned blocks, a
# batch of one or two requests copied straight from and to them) against none (=0: every batch
# packed and unpacked by the host, as before), interleaved twice. Bundle made here with
#   JOBS=2 server/backend/make_device_bundle.sh build .device/bundle
# and carried as .device/bundle. (The A/B part of this script was later factored out into
# client/loadgen/ab_h200.sh; this is the same run through it. The call wrote its JSON under
# ring/ with tags rR_ring0_* and rR_ring128_*: call27/ring/.)
set -u
B=$PWD/.device/bundle
for t in pagedattn_cuda_staging_test pagedattn_cuda_backend_test; do
  LD_LIBRARY_PATH=$B/lib timeout 200 $B/bin/$t --gtest_brief=1 >> $OUT/tests.log 2>&1
  echo "$t rc=$?"
done
client/loadgen/ab_h200.sh ring0=pagedattn-server,--cuda_host_ring_mib=0 ring128=pagedattn-server
