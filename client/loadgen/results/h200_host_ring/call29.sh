#!/bin/bash
# Device call 29 (2026-12-04): an A/B interleaved twice of the row copies issued before the
# decoder's plan (pagedattn-server, commit a5a2be7) against after it (pagedattn-server-call28,
# the binary of call 28), defaults otherwise (the ring on, kernel-written outputs); then the
# full figures run (server/backend/device_e2e.sh: the GPU tests, the server, run_h200.sh) with
# the new binary, into e2e/. Bundle made here with
#   JOBS=2 server/backend/make_device_bundle.sh build .device/bundle
# and carried as .device/bundle.
set -u
B=$PWD/.device/bundle
export LD_LIBRARY_PATH=$B/lib
W=$OUT/ring
mkdir -p $W
AB=$OUT/ab.log
: > $AB
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >> $AB
start() {  # start BINARY
  local name=$1; shift
  $B/bin/$name --backend=cuda --grpc_address=127.0.0.1:0 --metrics_address=127.0.0.1:0 \
    --num_layers=1 --max_batch_size=64 --max_queue_delay_us=0 --num_pages=200000 \
    "$@" > $W/server_$name.log 2>&1 &
  pid=$!
  for _ in $(seq 1 200); do line=$(grep -m1 "serving grpc=" $W/server_$name.log) && break; sleep 0.25; done
  grpc=$(sed -E 's/.*grpc=([^ ]+).*/\1/' <<< "$line"); metrics=$(sed -E 's/.*metrics=([^ ]+).*/\1/' <<< "$line")
}
lg() {
  local name=$1; shift
  echo "== $name $*" >> $AB
  timeout 60 $B/bin/pagedattn-loadgen --target=$grpc --metrics_address=$metrics --batch_size=64 --context_len=4096 \
    --warmup_steps=20 --steps=400 --out=$W/$name.json "$@" 2>/dev/null | grep -E "throughput|server|latency|check" >> $AB
}
for round in 1 2; do
  for variant in planfirst rowsfirst; do
    tag=r${round}_$variant
    case $variant in
      planfirst) start pagedattn-server-call28 ;;
      rowsfirst) start pagedattn-server ;;
    esac
    lg ${tag}_c1 --concurrency=1 --check_sequences=8
    lg ${tag}_c1_attend --concurrency=1 --decode_kv=false
    lg ${tag}_b1 --concurrency=1 --batch_size=1 --context_len=512 --steps=2000
    lg ${tag}_s4 --concurrency=4 --api=stream --stream_in_flight=2
    lg ${tag}_c8 --concurrency=8
    kill -TERM $pid; wait $pid; echo "server $variant exit $?" >> $AB
  done
done
tar -czf $OUT/ring.tar.gz -C $OUT ring && rm -rf $W
mkdir -p $OUT/e2e
OUT=$OUT/e2e SERVER_FLAGS="--num_layers=1 --max_batch_size=64 --max_queue_delay_us=0 --num_pages=200000" \
  LOADGEN_TIMEOUT=330 TEST_TIMEOUT=150 timeout 450 server/backend/device_e2e.sh .device/bundle > /dev/null 2>&1
echo "e2e rc=$?" >> $AB
cp $OUT/e2e/e2e.log $OUT/e2e/figures.md $OUT/ 2>/dev/null
tar -czf $OUT/e2e.tar.gz -C $OUT e2e && rm -rf $OUT/e2e
grep -E "^==|batch launch|throughput:|check|e2e rc" $AB | head -60
grep -E "^ok|^FAIL" $OUT/e2e.log
