#!/usr/bin/env bash
# The figures of tensors by reference on a GPU host: the same decode steps with tensors inline,
# in a registered shared-memory region (system) and in registered device memory (cuda), each
# beside the bare gRPC round trip (GetModelConfig) and the kernel's own time, in one run.
#   client/loadgen/run_tensors_h200.sh OUT_DIR [BUNDLE]
# BUNDLE (default .device/bundle, made by server/backend/make_device_bundle.sh) holds
# pagedattn-server and pagedattn-loadgen built with CUDA. Two servers run one after the other,
# each with one layer, batches of 64 and no batching delay: on 127.0.0.1 (TCP) and on a Unix
# socket. Writes OUT_DIR/<run>.json, summary.txt and tensors.md (the table against the targets),
# and grpc_floor_{tcp,unix}.txt (pagedattn_grpc_floor_bench, when the bundle has it).
# SMOKE=1: tiny shapes, for trying the script on a CPU-backend server (cuda runs are skipped).
# KINDS: the tensor kinds to run (default "inline system cuda").
# SERVER: the server binary's name in BUNDLE/bin (default pagedattn-server), to measure a variant.
set -uo pipefail
out=${1:?usage: run_tensors_h200.sh OUT_DIR [BUNDLE]}
bundle=$(cd "${2:-.device/bundle}" && pwd) || exit 2
cd "$(dirname "$0")/../.."
export LD_LIBRARY_PATH=$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
mkdir -p "$out"
: > "$out/summary.txt"
b=64 ctx=4096 small_ctx=512 steps=400 small_steps=2000 kinds=${KINDS:-"inline system cuda"} backend=cuda
if [[ ${SMOKE:-0} == 1 ]]; then
  b=4 ctx=256 small_ctx=128 steps=20 small_steps=50 kinds="inline system" backend=cpu
fi
server_pid=
start_server() {  # start_server ADDRESS
  "$bundle/bin/${SERVER:-pagedattn-server}" --backend=$backend --grpc_address="$1" --metrics_address=127.0.0.1:0 \
    --num_layers=1 --max_batch_size=64 --max_queue_delay_us=0 --num_pages=40000 \
    > "$out/server_${2}.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 1 200); do grep -q "serving grpc=" "$out/server_${2}.log" && break; sleep 0.1; done
  target=$(grep -o "grpc=[^ ]*" "$out/server_${2}.log" | cut -d= -f2)
  metrics=$(grep -o "metrics=[^ ]*" "$out/server_${2}.log" | cut -d= -f2)
}
stop_server() { kill -TERM "$server_pid"; wait "$server_pid"; echo "server exit $?" >> "$out/summary.txt"; }
run() {  # run NAME ARGS...
  local name=$1
  shift
  echo "== $name $*" >> "$out/summary.txt"
  timeout 120 "$bundle/bin/pagedattn-loadgen" --target="$target" --metrics_address="$metrics" \
    --out="$out/$name.json" --rpc_floor_samples=200 "$@" >> "$out/summary.txt" 2>&1 ||
    echo "!! $name failed" >> "$out/summary.txt"
}

start_server 127.0.0.1:0 tcp
for kind in $kinds; do
  run "tcp_b${b}_c1_$kind" --tensors=$kind --concurrency=1 --batch_size=$b --context_len=$ctx \
    --warmup_steps=20 --steps=$steps --check_sequences=4 --check_decodes=32
done
for kind in $kinds; do
  run "tcp_b${b}_s4_$kind" --tensors=$kind --concurrency=4 --api=stream --stream_in_flight=2 \
    --batch_size=$b --context_len=$ctx --warmup_steps=20 --steps=$steps
done
stop_server
start_server "unix:/tmp/pagedattn-tensors-$$.sock" unix
for kind in $kinds; do
  run "unix_b1_c1_$kind" --tensors=$kind --concurrency=1 --batch_size=1 --context_len=$small_ctx \
    --warmup_steps=200 --steps=$small_steps --check_sequences=1 --check_decodes=32
done
stop_server
# What gRPC alone charges for the same bytes (opaque payloads between two processes, no
# protobuf, no service): the floor of the inline runs above, beside their p50 - kernel - round trip.
if [[ -x $bundle/bin/pagedattn_grpc_floor_bench ]]; then
  for via in tcp unix; do
    timeout 120 "$bundle/bin/pagedattn_grpc_floor_bench" 2000 $([[ $via == unix ]] && echo unix) \
      > "$out/grpc_floor_$via.txt" 2>&1 || echo "!! grpc floor ($via) failed" >> "$out/summary.txt"
  done
fi
python3 client/loadgen/tensors_table.py "$out" > "$out/tensors.md"
cat "$out/tensors.md"
