#!/bin/bash
# Device calls 32-33 (2026-12-04): where a c1 step's launch goes, host and device side.
# launch_trace.patch (applied to cuda_backend.cc of commit a9a8a32 for these calls only, never
# committed) stamps the host clock at each step of Launch/Enqueue and at Wait, and records two
# more events (after the row copy, after the tables copy); with PAGEDATTN_TRACE set the server
# prints the medians per batch shape (batch size * 10 + 1 when it writes tokens) at exit.
# Built here into a bundle (server/backend/make_device_bundle.sh build .device/diag), this
# script copied to .device/diag/run.sh, carried as [".device/diag"].
# Call 32: .device/diag/run.sh "default|"  (call32_trace.log)
# Call 33: .device/diag/run.sh "default|" "nospin|--idle_spin_us=0" \
#            "nocompl|--completion_thread=off" "neither|--idle_spin_us=0 --completion_thread=off"
#          (call33_trace_spin.log)
B=$PWD/.device/diag
export LD_LIBRARY_PATH=$B/lib
OUT=${OUT:-/tmp/o}
for spec in "$@"; do
  name=${spec%%|*}; flags=${spec#*|}
  echo "######## $name: $flags"
  PAGEDATTN_TRACE=1 $B/bin/pagedattn-server --backend=cuda --grpc_address=127.0.0.1:0 \
    --metrics_address=127.0.0.1:0 --num_layers=1 --max_batch_size=64 --max_queue_delay_us=0 \
    --num_pages=200000 $flags > $OUT/server_$name.log 2>&1 &
  pid=$!
  for _ in $(seq 1 200); do line=$(grep -m1 "serving grpc=" $OUT/server_$name.log) && break; sleep 0.25; done
  grpc=$(sed -E 's/.*grpc=([^ ]+).*/\1/' <<< "$line"); metrics=$(sed -E 's/.*metrics=([^ ]+).*/\1/' <<< "$line")
  lg() { tag=$1; shift; echo "== $tag $*"; timeout 60 $B/bin/pagedattn-loadgen --target=$grpc \
    --metrics_address=$metrics --batch_size=64 --context_len=4096 --warmup_steps=20 --steps=400 \
    --out=$OUT/${name}_$tag.json "$@" 2>/dev/null | grep -E "launch->done|stage means"; }
  lg c1 --concurrency=1
  lg c1_attend --concurrency=1 --decode_kv=false
  lg b1 --concurrency=1 --batch_size=1 --context_len=512 --steps=2000
  kill -TERM $pid; wait $pid
  grep DIAG $OUT/server_$name.log
done
