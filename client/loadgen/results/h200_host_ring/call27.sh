#!/bin/bash
# Device call 27 (2026-12-04): the CUDA backend's GPU tests with the host ring, then an A/B of
# the ring (--cuda_host_ring_mib=128, the default: Decodes received into pinned blocks, a batch
# of one or two requests copied straight from and to them) against none (=0: every batch packed
# and unpacked by the host, as before), interleaved twice. Bundle made here with
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
for t in pagedattn_cuda_staging_test pagedattn_cuda_backend_test; do
  timeout 200 $B/bin/$t --gtest_brief=1 >> $OUT/tests.log 2>&1
  echo "$t rc=$?" | tee -a $AB
done
grep -E "^\[  (PASSED|FAILED|SKIPPED)" $OUT/tests.log >> $AB
start() {  # start RING_MIB
  $B/bin/pagedattn-server --backend=cuda --grpc_address=127.0.0.1:0 --metrics_address=127.0.0.1:0 \
    --num_layers=1 --max_batch_size=64 --max_queue_delay_us=0 --num_pages=200000 \
    --cuda_host_ring_mib=$1 > $W/server_$1.log 2>&1 &
  pid=$!
  for _ in $(seq 1 200); do line=$(grep -m1 "serving grpc=" $W/server_$1.log) && break; sleep 0.25; done
  grpc=$(sed -E 's/.*grpc=([^ ]+).*/\1/' <<< "$line"); metrics=$(sed -E 's/.*metrics=([^ ]+).*/\1/' <<< "$line")
}
lg() {
  local name=$1; shift
  echo "== $name $*" >> $AB
  timeout 60 $B/bin/pagedattn-loadgen --target=$grpc --metrics_address=$metrics --batch_size=64 --context_len=4096 \
    --warmup_steps=20 --steps=400 --out=$W/$name.json "$@" 2>/dev/null | grep -E "throughput|server|latency|check" >> $AB
}
for round in 1 2; do
  for mib in 0 128; do
    tag=r${round}_ring$mib
    start $mib
    lg ${tag}_c1 --concurrency=1 --check_sequences=8
    lg ${tag}_c1_attend --concurrency=1 --decode_kv=false
    lg ${tag}_b1 --concurrency=1 --batch_size=1 --context_len=512 --steps=2000
    lg ${tag}_s4 --concurrency=4 --api=stream --stream_in_flight=2
    lg ${tag}_c8 --concurrency=8
    kill -TERM $pid; wait $pid; echo "server ring=$mib exit $?" >> $AB
  done
done
tar -czf $OUT/ring.tar.gz -C $OUT ring && rm -rf $W
grep -E "^==|stage means|batch launch|throughput:" $AB | head -80
