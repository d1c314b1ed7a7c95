#!/bin/bash
# Device call 29 (2026-12-04): an A/B interleaved twice of the row copies issued before the
# decoder's plan (pagedattn-server, commit a5a2be7) against after it (pagedattn-server-call28,
# the binary of call 28), defaults otherwise (the ring on, kernel-written outputs); then the
# full figures run (server/backend/device_e2e.sh: the GPU tests, the server, run_h200.sh) with
# the new binary. (Run then as a script of its own; this is the same run through
# client/loadgen/ab_h200.sh. JSON: call29/ring/; figures: call29_figures.md.)
set -u
client/loadgen/ab_h200.sh planfirst=pagedattn-server-call28 rowsfirst=pagedattn-server
mkdir -p $OUT/e2e
OUT=$OUT/e2e SERVER_FLAGS="--num_layers=1 --max_batch_size=64 --max_queue_delay_us=0 --num_pages=200000" \
  LOADGEN_TIMEOUT=330 TEST_TIMEOUT=150 timeout 450 server/backend/device_e2e.sh .device/bundle > /dev/null 2>&1
echo "e2e rc=$?"
cp $OUT/e2e/e2e.log $OUT/e2e/figures.md $OUT/ 2>/dev/null
tar -czf $OUT/e2e.tar.gz -C $OUT e2e && rm -rf $OUT/e2e
grep -E "^ok|^FAIL" $OUT/e2e.log
