#!/bin/bash
# Device call 2 of 2026-12-03: A/B of --cuda_copy_threads (2, 4, 8) and of the HTTP/2 frame size
# (gRPC's 16 KiB, 1 MiB on both sides), B=64 x 4096 at c1, c8 and s4, and B=1 at c1.
set -u
mkdir -p $OUT/ab2
B=$PWD/.device/bundle
export LD_LIBRARY_PATH=$B/lib
AB=$OUT/ab2/ab.log
: > $AB
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >> $AB
start() {
  $B/bin/pagedattn-server --backend=cuda --grpc_address=127.0.0.1:0 --metrics_address=127.0.0.1:0 \
    --num_layers=1 --max_batch_size=64 --max_queue_delay_us=0 --num_pages=200000 "$@" > $OUT/ab2/server.log 2>&1 &
  pid=$!
  for _ in $(seq 1 200); do line=$(grep -m1 "serving grpc=" $OUT/ab2/server.log) && break; sleep 0.25; done
  grpc=$(sed -E 's/.*grpc=([^ ]+).*/\1/' <<< "$line"); metrics=$(sed -E 's/.*metrics=([^ ]+).*/\1/' <<< "$line")
}
lg() {
  local name=$1; shift
  echo "== $name $*" >> $AB
  timeout 60 $B/bin/pagedattn-loadgen --target=$grpc --metrics_address=$metrics --batch_size=64 --context_len=4096 \
    --warmup_steps=20 --steps=400 --out=$OUT/ab2/$name.json "$@" 2>/dev/null | grep -E "throughput|server|latency" >> $AB
}
set3() {  # set3 NAME SERVER_FLAG CLIENT_FLAG
  start $2
  lg ${1}_c1 --concurrency=1 $3
  lg ${1}_c8 --concurrency=8 $3
  lg ${1}_s4 --concurrency=4 --api=stream --stream_in_flight=2 $3
  lg ${1}_b1 --concurrency=1 --batch_size=1 --context_len=512 --steps=2000 $3
  kill -TERM $pid; wait $pid
}
for round in 1 2; do
  set3 r${round}_copy4 --cuda_copy_threads=4 ""
  set3 r${round}_copy8 --cuda_copy_threads=8 ""
  set3 r${round}_copy2 --cuda_copy_threads=2 ""
  set3 r${round}_frame1m --http2_max_frame_bytes=1048576 --http2_max_frame_bytes=1048576
done
tar -czf $OUT/ab2.tar.gz -C $OUT ab2
cp $AB $OUT/ab2.log
rm -rf $OUT/ab2
grep -E "^==|throughput:|stage means|request mean|latency" $OUT/ab2.log | sed -E 's/sequence-decodes\/s.*//' | head -200
echo "== launch sequence (v6 params vs table)" > $OUT/launch_sequence.log
timeout 200 .device/bin/pagedattn-kernel-bench --workloads .device/one.jsonl --no-uneven --no-cpasync --iters 20 --launch-sequence --out /tmp/ls.jsonl >> $OUT/launch_sequence.log 2>&1
echo "rc=$?" >> $OUT/launch_sequence.log
sed -n '/launch sequence/,$p' $OUT/launch_sequence.log
echo "== host copy rates" > $OUT/hostcopy.log
nproc >> $OUT/hostcopy.log; lscpu | grep -E "Model name|Socket|NUMA node" >> $OUT/hostcopy.log
timeout 60 .device/bin/hostcopy >> $OUT/hostcopy.log 2>&1
echo "rc=$?" >> $OUT/hostcopy.log
cat $OUT/hostcopy.log
