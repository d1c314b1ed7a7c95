#!/bin/bash
# Device call 37 (2026-12-04), run as this command line: an A/B interleaved twice of the
# kernel appends (binary of commit 82b9572's first form: appends, the old launch order) against
# the scatter (--cuda_kernel_appends=false), one binary. Output: call37_ab.log, call37_ab.tar.gz.
OUT=/tmp/ab ROUNDS=2 client/loadgen/ab_h200.sh kernel=pagedattn-server \
  scatter=pagedattn-server,--cuda_kernel_appends=false > /dev/null 2>&1
cp /tmp/ab/ab.log $OUT/call37_ab.log
cp /tmp/ab/ab.tar.gz $OUT/call37_ab.tar.gz
