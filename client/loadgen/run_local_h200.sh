#!/usr/bin/env bash
# The local channel's figures on a GPU host: the same decode steps over gRPC and over local
# channels (--transport=local), tensors in registered device memory (cuda), against the
# kernel's own time; one server on a Unix socket per shape.
#   client/loadgen/run_local_h200.sh OUT_DIR [BUNDLE]
# BUNDLE (default .device/bundle, made by server/backend/make_device_bundle.sh) holds
# pagedattn-server and pagedattn-loadgen built with CUDA. Runs (issue targets in brackets):
#   b64_ctx4096_c1_{grpc,local}   one caller, B=64 x 4096      [local p50 <= 1.15x kernel mean]
#   b1_ctx512_c1_{grpc,local}     one caller, B=1 x 512        [local p50 <= kernel + 15 us]
#   l56_b64_ctx4096_{grpc,local}  56 layers per step, B=64     [step <= 1.2 x 56 kernels]
#   b64_ctx4096_c2_local          two callers, B=64 each       [>= 0.97 of kernel-alone throughput]
#   *_gsync                       the same over local channels with the steps ordered on the
#                                 callers' GPU (--local_gpu_sync, 4 submissions outstanding)
#   *_gsync_timed                 the same, with CUDA events on the caller's stream timing each
#                                 step there ("device latency"): run beside the untimed ones
#                                 because the events may cost the server's kernels time
# Writes OUT_DIR/<run>.json and summary.txt. SMOKE=1: tiny shapes on a CPU-backend server with
# system regions, to try the script without a GPU. SERVER: the server binary's name in BUNDLE/bin
# (default pagedattn-server), to measure a variant; L56=0 leaves out the 56-layer runs; MPS=1
# runs everything under an MPS control daemon started here (one GPU context for the server and
# the loadgen: what a GPU caller that records its own work between layers needs; see
# docs/operations.md) and stopped at the end.
set -uo pipefail
out=${1:?usage: run_local_h200.sh OUT_DIR [BUNDLE]}
bundle=$(cd "${2:-.device/bundle}" && pwd) || exit 2
cd "$(dirname "$0")/../.."
export LD_LIBRARY_PATH=$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
mkdir -p "$out"
: > "$out/summary.txt"
b=64 ctx=4096 small_ctx=512 steps=400 small_steps=2000 l56_steps=50 tensors=cuda backend=cuda
pages=40000 l56_pages=5000
if [[ ${SMOKE:-0} == 1 ]]; then
  b=4 ctx=256 small_ctx=128 steps=20 small_steps=50 l56_steps=3 tensors=system backend=cpu
  pages=2000 l56_pages=100
fi
if [[ ${MPS:-0} == 1 ]]; then
  source server/backend/mps.sh
  start_mps || exit 2
  echo "$MPS_LINE" >> "$out/summary.txt"
fi
socket=/tmp/pagedattn-local-$$.sock
server_pid=
start_server() {  # start_server NAME LAYERS PAGES
  "$bundle/bin/${SERVER:-pagedattn-server}" --backend=$backend --grpc_address="unix:$socket" \
    --metrics_address=127.0.0.1:0 --num_layers="$2" --num_pages="$3" --max_batch_size=64 \
    --max_queue_delay_us=0 --local_spin_us=1000 > "$out/server_$1.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 1 300); do grep -q "serving grpc=" "$out/server_$1.log" && break; sleep 0.1; done
  target=$(grep -o "grpc=[^ ]*" "$out/server_$1.log" | cut -d= -f2)
  metrics=$(grep -o "metrics=[^ ]*" "$out/server_$1.log" | cut -d= -f2)
}
stop_server() { kill -TERM "$server_pid"; wait "$server_pid"; echo "server exit $?" >> "$out/summary.txt"; }
run() {  # run NAME ARGS...
  local name=$1
  shift
  echo "== $name $*" >> "$out/summary.txt"
  timeout 300 "$bundle/bin/pagedattn-loadgen" --target="$target" --metrics_address="$metrics" \
    --out="$out/$name.json" --rpc_floor_samples=200 --tensors=$tensors "$@" >> "$out/summary.txt" 2>&1 ||
    echo "!! $name failed" >> "$out/summary.txt"
}

start_server one_layer 1 $pages
for transport in grpc local; do
  run "b${b}_ctx${ctx}_c1_$transport" --transport=$transport --concurrency=1 --batch_size=$b \
    --context_len=$ctx --warmup_steps=20 --steps=$steps --check_sequences=4 --check_decodes=32
  run "b1_ctx${small_ctx}_c1_$transport" --transport=$transport --concurrency=1 --batch_size=1 \
    --context_len=$small_ctx --warmup_steps=200 --steps=$small_steps --check_sequences=1 --check_decodes=32
done
run "b${b}_ctx${ctx}_c2_local" --transport=local --concurrency=2 --batch_size=$b --context_len=$ctx \
  --warmup_steps=20 --steps=$steps
if [[ $tensors == cuda ]]; then
  run "b${b}_ctx${ctx}_c1_gsync" --transport=local --local_gpu_sync --stream_in_flight=4 --concurrency=1 \
    --batch_size=$b --context_len=$ctx --warmup_steps=20 --steps=$steps --check_sequences=4 --check_decodes=32
  run "b${b}_ctx${ctx}_c2_gsync" --transport=local --local_gpu_sync --stream_in_flight=4 --concurrency=2 \
    --batch_size=$b --context_len=$ctx --warmup_steps=20 --steps=$steps
  run "b1_ctx${small_ctx}_c1_gsync" --transport=local --local_gpu_sync --stream_in_flight=4 --concurrency=1 \
    --batch_size=1 --context_len=$small_ctx --warmup_steps=200 --steps=$small_steps --check_sequences=1 --check_decodes=32
  for shape in "$b $ctx $steps" "1 $small_ctx $small_steps"; do
    read -r tb tctx tsteps <<< "$shape"
    run "b${tb}_ctx${tctx}_c1_gsync_timed" --transport=local --local_gpu_sync --stream_in_flight=4 --device_latency \
      --concurrency=1 --batch_size=$tb --context_len=$tctx --warmup_steps=20 --steps=$tsteps
  done
fi
stop_server
if [[ ${L56:-1} != 0 ]]; then
  start_server l56 56 $l56_pages
  for transport in grpc local; do
    run "l56_b${b}_ctx${ctx}_$transport" --transport=$transport --concurrency=1 --batch_size=$b \
      --context_len=$ctx --warmup_steps=2 --steps=$l56_steps --check_sequences=2 --check_decodes=16
  done
  if [[ $tensors == cuda ]]; then
    run "l56_b${b}_ctx${ctx}_gsync" --transport=local --local_gpu_sync --stream_in_flight=4 --concurrency=1 \
      --batch_size=$b --context_len=$ctx --warmup_steps=2 --steps=$l56_steps --check_sequences=2 --check_decodes=16
  fi
  stop_server
fi
rm -f "$socket"
grep -E "^==|latency|kernel mean|throughput|check|!!" "$out/summary.txt"
