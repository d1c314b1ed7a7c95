#!/usr/bin/env bash
# A/B of server variants on one GPU host, in one run: each variant's server is started
# in turn and the same five short loadgen runs go against it, and the whole is repeated
# (interleaved) ROUNDS times, so the variants meet the same host conditions.
#   client/loadgen/ab_h200.sh NAME=BINARY[,FLAG...] ...
# BINARY is a file in $BUNDLE/bin (default .device/bundle, made by
# server/backend/make_device_bundle.sh); FLAGs are extra server flags, e.g.
#   client/loadgen/ab_h200.sh base=pagedattn-server,--cuda_host_ring_mib=0 new=pagedattn-server
# Every server: --backend=cuda, one layer, batches of 64, no batching delay, 200,000 pages. The
# runs (tags rR_NAME_RUN): c1 (B=64 x 4096, one unary caller, 8 sequences checked against the
# CPU reference), c1_attend (no k/v appended), b1 (B=1 x 512), s4 (4 streaming callers, 2 in
# flight each), c8 (8 unary callers); 400 steps each (2,000 for b1).
# Writes $OUT/ab.log (the loadgen summaries) and $OUT/ab.tar.gz (every run's JSON and the server
# logs). Environment: OUT (default /tmp/pagedattn-ab), BUNDLE, ROUNDS (default 2).
set -u
B=${BUNDLE:-$PWD/.device/bundle}
OUT=${OUT:-/tmp/pagedattn-ab}
export LD_LIBRARY_PATH=$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
W=$OUT/ab
AB=$OUT/ab.log
mkdir -p "$W"
: > "$AB"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >> "$AB"

start() {  # start NAME BINARY FLAGS...
  local name=$1 binary=$2
  shift 2
  "$B/bin/$binary" --backend=cuda --grpc_address=127.0.0.1:0 --metrics_address=127.0.0.1:0 \
    --num_layers=1 --max_batch_size=64 --max_queue_delay_us=0 --num_pages=200000 \
    "$@" > "$W/server_$name.log" 2>&1 &
  pid=$!
  line=
  for _ in $(seq 1 200); do line=$(grep -m1 "serving grpc=" "$W/server_$name.log") && break; sleep 0.25; done
  grpc=$(sed -E 's/.*grpc=([^ ]+).*/\1/' <<< "$line")
  metrics=$(sed -E 's/.*metrics=([^ ]+).*/\1/' <<< "$line")
}
lg() {  # lg TAG LOADGEN_FLAGS...
  local tag=$1
  shift
  echo "== $tag $*" >> "$AB"
  timeout 60 "$B/bin/pagedattn-loadgen" --target="$grpc" --metrics_address="$metrics" \
    --batch_size=64 --context_len=4096 --warmup_steps=20 --steps=400 --out="$W/$tag.json" "$@" \
    2> /dev/null | grep -E "throughput|server|latency|check" >> "$AB"
}
for round in $(seq 1 "${ROUNDS:-2}"); do
  for spec in "$@"; do
    name=${spec%%=*}
    IFS=, read -r -a parts <<< "${spec#*=}"
    start "$name" "${parts[@]}"
    tag=r${round}_$name
    lg "${tag}_c1" --concurrency=1 --check_sequences=8
    lg "${tag}_c1_attend" --concurrency=1 --decode_kv=false
    lg "${tag}_b1" --concurrency=1 --batch_size=1 --context_len=512 --steps=2000
    lg "${tag}_s4" --concurrency=4 --api=stream --stream_in_flight=2
    lg "${tag}_c8" --concurrency=8
    kill -TERM "$pid"
    wait "$pid"
    echo "server $name exit $?" >> "$AB"
  done
done
tar -czf "$OUT/ab.tar.gz" -C "$OUT" ab && rm -rf "$W"
grep -E "^==|batch launch|throughput:|check" "$AB"
