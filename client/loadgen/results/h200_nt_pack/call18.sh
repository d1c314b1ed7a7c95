#!/bin/bash
set -u
mkdir -p $OUT
.device/bin/h2d > $OUT/h2d.log 2>&1; echo "h2d rc=$?" >> $OUT/h2d.log
mkdir -p $OUT/e2e
OUT=$OUT/e2e STEPS=tests timeout 200 server/backend/device_e2e.sh .device/bundle > /dev/null 2>&1
echo "tests rc=$?" >> $OUT/h2d.log
cp $OUT/e2e/e2e.log $OUT/tests_e2e.log; cp $OUT/e2e/tests.log $OUT/tests.log; rm -rf $OUT/e2e
cat $OUT/h2d.log; grep -E "^ok|^FAIL|PASSED|FAILED" $OUT/tests_e2e.log
