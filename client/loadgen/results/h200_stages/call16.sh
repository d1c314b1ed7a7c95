#!/bin/bash
# Device call 1 of 2026-12-03: kernel GPU tests + bench (FoldPiece check), in-flight A/B with the
# stage breakdown, the full e2e figures with the defaults. <= 8 files in $OUT.
set -u
mkdir -p $OUT
R=$OUT/run.log
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; date; } > $R
echo "== kernels" >> $R
mkdir -p $OUT/k
OUT=$OUT/k BIN=.device/bin timeout 280 kernels/bench/device_run.sh tests bench >> $R 2>&1
echo "kernels rc=$?" >> $R
tar -czf $OUT/kernel.tar.gz -C $OUT k && rm -rf $OUT/k
date >> $R

B=$PWD/.device/bundle
export LD_LIBRARY_PATH=$B/lib
mkdir -p $OUT/ab
AB=$OUT/ab/ab.log
: > $AB
start() {
  $B/bin/pagedattn-server --backend=cuda --grpc_address=127.0.0.1:0 --metrics_address=127.0.0.1:0 \
    --num_layers=1 --max_batch_size=64 --max_queue_delay_us=0 --num_pages=200000 "$@" > $OUT/ab/server.log 2>&1 &
  pid=$!
  for _ in $(seq 1 200); do line=$(grep -m1 "serving grpc=" $OUT/ab/server.log) && break; sleep 0.25; done
  grpc=$(sed -E 's/.*grpc=([^ ]+).*/\1/' <<< "$line"); metrics=$(sed -E 's/.*metrics=([^ ]+).*/\1/' <<< "$line")
}
lg() {
  local name=$1; shift
  echo "== $name $*" >> $AB
  timeout 60 $B/bin/pagedattn-loadgen --target=$grpc --metrics_address=$metrics --batch_size=64 --context_len=4096 \
    --warmup_steps=20 --steps=400 --out=$OUT/ab/$name.json "$@" 2>/dev/null | grep -E "throughput|server|latency" >> $AB
}
echo "== ab" >> $R
for n in 2 3; do
  start --cuda_max_in_flight=$n
  lg f${n}_c1 --concurrency=1
  lg f${n}_c4 --concurrency=4
  lg f${n}_c8 --concurrency=8
  lg f${n}_s4 --concurrency=4 --api=stream --stream_in_flight=2
  lg f${n}_b1 --concurrency=1 --batch_size=1 --context_len=512 --steps=2000
  kill -TERM $pid; wait $pid
done
cat $AB >> $R
tar -czf $OUT/ab.tar.gz -C $OUT ab && rm -rf $OUT/ab
date >> $R
echo "== e2e" >> $R
mkdir -p $OUT/e2e
OUT=$OUT/e2e SERVER_FLAGS="--num_layers=1 --max_batch_size=64 --max_queue_delay_us=0 --num_pages=200000" LOADGEN_TIMEOUT=300 \
  timeout 420 server/backend/device_e2e.sh .device/bundle > /dev/null 2>&1
echo "e2e rc=$?" >> $R
cp $OUT/e2e/e2e.log $OUT/e2e/figures.md $OUT/ 2>/dev/null
tar -czf $OUT/e2e.tar.gz -C $OUT e2e && rm -rf $OUT/e2e
date >> $R
tail -50 $R
