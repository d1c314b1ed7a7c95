#!/usr/bin/env bash
# The service's reference figures on an H200 host, against a pagedattn-server already running.
#   client/loadgen/run_h200.sh OUT_DIR
# Environment (defaults in brackets):
#   TARGET [127.0.0.1:50051]   METRICS [127.0.0.1:9464]   LOADGEN [build/bin/pagedattn-loadgen]
#   WORKLOAD_FILE [the loadgen's default, kernels/bench/workloads/]   PYTHON [python3]   QUICK [0: full lengths; 1: short runs]
#   SMOKE [0; 1: tiny shapes and few steps, to try the script against a CPU-backend server]
# With a bundle of server/backend/make_device_bundle.sh (the GPU host has no gRPC C++ libraries):
#   LD_LIBRARY_PATH=BUNDLE/lib LOADGEN=BUNDLE/bin/pagedattn-loadgen client/loadgen/run_h200.sh OUT_DIR
# Start the server with one layer, no batching delay and a pool of at least ~40k pages, e.g.
#   build/bin/pagedattn-server --backend=cuda --num_layers=1 --max_batch_size=64 --max_queue_delay_us=0 &
# (--max_queue_delay_us=0: a lone request is launched at once instead of waiting to fill a batch;
# with the default 200 us figure (b) measures the batching window, not the server's overhead).
# Writes OUT_DIR/{a_*,b_*,d_*}.json, sweep.json, sweep.png (when matplotlib is there),
# summary.txt (the loadgen's summaries) and figures.md (the reference figures against their targets).
set -uo pipefail
out=${1:?usage: run_h200.sh OUT_DIR}
cd "$(dirname "$0")/../.."
target=${TARGET:-127.0.0.1:50051}
metrics=${METRICS:-127.0.0.1:9464}
loadgen=${LOADGEN:-build/bin/pagedattn-loadgen}
python=${PYTHON:-python3}
quick=${QUICK:-0}
# The shapes of the figures; SMOKE shrinks them.
a_batch=64 a_ctx=4096 b_ctx=512 d_seqs=128 d_clamp=65536
sweep_b=1,2,4,8,16,32,64 sweep_ctx=512,1024,2048,4096,8192,16384
if [[ ${SMOKE:-0} == 1 ]]; then
  quick=1 a_batch=4 a_ctx=256 b_ctx=128 d_seqs=64 d_clamp=1024 sweep_b=1,4 sweep_ctx=128,512
fi
mkdir -p "$out"
: >"$out/summary.txt"
failed=0

warm() { if [[ ${SMOKE:-0} == 1 ]]; then echo 1; else echo "$1"; fi; }
steps() { if [[ ${SMOKE:-0} == 1 ]]; then echo 3; elif [[ $quick == 1 ]]; then echo "$2"; else echo "$1"; fi; }

run() {  # run NAME ARGS...: one loadgen run, its JSON in OUT_DIR/NAME.json
  local name=$1
  shift
  echo "== $name: $loadgen $*" | tee -a "$out/summary.txt"
  if "$loadgen" --target="$target" --metrics_address="$metrics" --out="$out/$name.json" "$@" \
      2> >(tee -a "$out/$name.log" >&2) | tee -a "$out/summary.txt"; then
    :
  else
    echo "!! $name failed" | tee -a "$out/summary.txt"
    failed=1
  fi
}

# (a) Batches of 64 sequences of 4,096 tokens, one layer, closed loop. One caller: the request's
# latency against the kernel's time for that batch. Four callers (four batches of 64 in flight):
# throughput against what the kernel alone sustains. Decode steps (k/v appended: contexts grow by
# the step count, reported as mean_context_tokens) and attend-only (exactly 4,096).
run a_b64_ctx4096_c1 --concurrency=1 --batch_size=$a_batch --context_len=$a_ctx --warmup_steps="$(warm 20)" \
  --steps="$(steps 500 50)" --check_sequences=4 --check_decodes=64
run a_b64_ctx4096_c1_attend --concurrency=1 --batch_size=$a_batch --context_len=$a_ctx --decode_kv=false \
  --warmup_steps="$(warm 20)" --steps="$(steps 500 50)"
run a_b64_ctx4096_c4 --concurrency=4 --batch_size=$a_batch --context_len=$a_ctx --warmup_steps="$(warm 20)" \
  --steps="$(steps 500 50)" --check_sequences=4 --check_decodes=64
run a_b64_ctx4096_c4_stream --concurrency=4 --api=stream --stream_in_flight=2 --batch_size=$a_batch \
  --context_len=$a_ctx --warmup_steps="$(warm 20)" --steps="$(steps 500 50)"
# Eight callers: enough batches in flight that the GPU, not one caller's round trip, is the limit.
run a_b64_ctx4096_c8 --concurrency=8 --batch_size=$a_batch --context_len=$a_ctx --warmup_steps="$(warm 20)" \
  --steps="$(steps 500 50)"

# (b) Single-sequence unary requests at low context: the server's added latency at p50
# (request p50 minus the kernel's mean time).
run b_b1_ctx512_c1 --concurrency=1 --batch_size=1 --context_len=$b_ctx --warmup_steps="$(warm 200)" \
  --steps="$(steps 5000 500)" --check_sequences=1 --check_decodes=64
run b_b1_ctx512_c1_attend --concurrency=1 --batch_size=1 --context_len=$b_ctx --decode_kv=false \
  --warmup_steps="$(warm 200)" --steps="$(steps 5000 500)"

# (d) Correctness end to end over the recorded workload's lengths (clamped to 64k tokens):
# sampled decodes against the float64 CPU reference.
workload_args=(--lengths=workload --max_workload_len=$d_clamp)
[[ -n ${WORKLOAD_FILE:-} ]] && workload_args+=(--workload_file="$WORKLOAD_FILE")
run d_workload_check "${workload_args[@]}" --workload_order=random --concurrency=4 --batch_size=16 --num_sequences=$d_seqs \
  --warmup_steps="$(warm 2)" --steps="$(steps 50 10)" --check_sequences=16 --check_decodes=128

# (c) The sweep for the plot: batch size x context length, one caller, decode steps.
run sweep --concurrency=1 --sweep_batch_sizes=$sweep_b \
  --sweep_context_lens=$sweep_ctx --warmup_steps="$(warm 10)" --steps="$(steps 200 20)"
if "$python" -c 'import matplotlib' 2>/dev/null; then
  "$python" client/loadgen/plot.py "$out/sweep.json" -o "$out/sweep.png" || failed=1
else
  echo "(no matplotlib for $python: run client/loadgen/plot.py $out/sweep.json elsewhere)" | tee -a "$out/summary.txt"
fi

"$python" client/loadgen/figures.py "$out" | tee "$out/figures.md" || failed=1
exit $failed
