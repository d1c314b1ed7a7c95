#!/bin/bash
# Device call 5 of 2026-12-03: A/B of planning before the pack (pagedattn-server-base: c6fd5ee,
# the plan after the input copy; pagedattn-server: the plan first), interleaved twice; then the figures run.
set -u
mkdir -p $OUT/pf
B=$PWD/.device/bundle
export LD_LIBRARY_PATH=$B/lib
AB=$OUT/pf/ab.log
: > $AB
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >> $AB
start() {  # start BINARY
  $B/bin/$1 --backend=cuda --grpc_address=127.0.0.1:0 --metrics_address=127.0.0.1:0 \
    --num_layers=1 --max_batch_size=64 --max_queue_delay_us=0 --num_pages=200000 > $OUT/pf/server.log 2>&1 &
  pid=$!
  for _ in $(seq 1 200); do line=$(grep -m1 "serving grpc=" $OUT/pf/server.log) && break; sleep 0.25; done
  grpc=$(sed -E 's/.*grpc=([^ ]+).*/\1/' <<< "$line"); metrics=$(sed -E 's/.*metrics=([^ ]+).*/\1/' <<< "$line")
}
lg() {
  local name=$1; shift
  echo "== $name $*" >> $AB
  timeout 60 $B/bin/pagedattn-loadgen --target=$grpc --metrics_address=$metrics --batch_size=64 --context_len=4096 \
    --warmup_steps=20 --steps=400 --out=$OUT/pf/$name.json "$@" 2>/dev/null | grep -E "throughput|server|latency" >> $AB
}
for round in 1 2; do
  for bin in pagedattn-server-base pagedattn-server; do
    tag=r${round}_$([[ $bin == pagedattn-server ]] && echo planfirst || echo base)
    start $bin
    lg ${tag}_c1 --concurrency=1
    lg ${tag}_c1_attend --concurrency=1 --decode_kv=false
    lg ${tag}_b1 --concurrency=1 --batch_size=1 --context_len=512 --steps=2000
    lg ${tag}_s4 --concurrency=4 --api=stream --stream_in_flight=2
    kill -TERM $pid; wait $pid
  done
done
tar -czf $OUT/pf.tar.gz -C $OUT pf && cp $AB $OUT/pf_ab.log && rm -rf $OUT/pf
grep -E "^==|stage means|batch launch" $OUT/pf_ab.log
mkdir -p $OUT/e2e
OUT=$OUT/e2e SERVER_FLAGS="--num_layers=1 --max_batch_size=64 --max_queue_delay_us=0 --num_pages=200000" LOADGEN_TIMEOUT=300 \
  timeout 400 server/backend/device_e2e.sh .device/bundle > /dev/null 2>&1
echo "e2e rc=$?"
cp $OUT/e2e/e2e.log $OUT/e2e/figures.md $OUT/ 2>/dev/null
tar -czf $OUT/e2e.tar.gz -C $OUT e2e && rm -rf $OUT/e2e
grep -E "^ok|^FAIL" $OUT/e2e.log
