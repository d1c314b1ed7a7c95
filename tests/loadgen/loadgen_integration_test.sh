#!/usr/bin/env bash
# pagedattn-loadgen against a real pagedattn-server (CPU backend, small pool) on loopback.
#   loadgen_integration_test.sh SERVER LOADGEN PYTHON SOURCE_DIR CASE
# CASE: closed_unary | closed_stream | closed_local | open_workload | sweep | shape_fp8 | shape_fp16_d256.
# Each starts its own server on free ports, runs a few seconds of load and asserts on the JSON with
# check_result.py. The shape_* cases start the server with another model shape (the loadgen takes
# every size from GetModelConfig) and keep the reference check on.
set -euo pipefail
server_bin=$1 loadgen_bin=$2 python=$3 src=$4 case=$5
here=$src/tests/loadgen
work=$(mktemp -d "${TMPDIR:-/tmp}/loadgen_test.XXXXXX")
server_pid=
cleanup() {
  if [[ -n $server_pid ]] && kill -0 "$server_pid" 2>/dev/null; then
    kill -TERM "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

# The server's model shape: the default, or another one for the shape_* cases.
shape_flags=()
case $case in
  shape_fp8)
    # Llama-3.1-8B: 32 query heads, 8 KV heads, head size 128, pages of 16, fp8 pages with a scale
    # per layer (not powers of two: another scale would round the values to other fp8 codes).
    printf '{"k_scale": [0.021, 0.033], "v_scale": [0.043, 0.057]}\n' >"$work/kv_scales.in"
    shape_flags=(--num_qo_heads=32 --num_kv_heads=8 --head_dim=128 --page_size=16 --dtype=bf16
                 --kv_cache_dtype=fp8_e4m3 "--kv_cache_scales_file=$work/kv_scales.in")
    ;;
  shape_fp16_d256)
    shape_flags=(--num_qo_heads=16 --num_kv_heads=8 --head_dim=256 --page_size=32 --dtype=fp16)
    ;;
esac
"$server_bin" --backend=cpu --grpc_address=127.0.0.1:0 --metrics_address=127.0.0.1:0 --num_pages=512 \
  --num_layers=2 --cpu_threads=1 --max_queue_delay_us=100 --drain_timeout=2s "${shape_flags[@]}" \
  >"$work/server.out" 2>&1 &
server_pid=$!
for _ in $(seq 100); do
  grep -q 'serving grpc=' "$work/server.out" && break
  kill -0 "$server_pid" 2>/dev/null || { cat "$work/server.out"; echo "server exited"; exit 1; }
  sleep 0.1
done
line=$(grep 'serving grpc=' "$work/server.out") || { cat "$work/server.out"; echo "server did not start"; exit 1; }
grpc=$(sed -E 's/.*grpc=([^ ]+).*/\1/' <<<"$line")
metrics=$(sed -E 's/.*metrics=([^ ]+).*/\1/' <<<"$line")
echo "server at grpc=$grpc metrics=$metrics"

loadgen() {
  timeout 120 "$loadgen_bin" --target="$grpc" --metrics_address="$metrics" --wait_for_server=5s "$@"
}

case $case in
  closed_unary)
    loadgen --batch_size=4 --concurrency=2 --lengths=uniform --min_context_len=50 --max_context_len=400 \
      --steps=8 --check_sequences=3 --out="$work/r.json"
    "$python" "$here/check_result.py" "$work/r.json"
    # The same with busy-polled calls, registered shared-memory tensors and their reference check.
    loadgen --busy_poll --tensors=system --batch_size=4 --concurrency=2 --context_len=130 --steps=8 \
      --check_sequences=2 --out="$work/busy.json"
    "$python" "$here/check_result.py" "$work/busy.json"
    grep -q '"busy_poll": *true' "$work/busy.json" || { echo "busy_poll not in the result's config"; exit 1; }
    # A pool too small for the request: refused before anything is created, exit 1.
    rc=0
    loadgen --batch_size=64 --context_len=4096 --steps=1 2>"$work/err.txt" || rc=$?
    [[ $rc == 1 ]] || { echo "expected exit 1 for an oversized run, got $rc"; exit 1; }
    grep -q FAILED_PRECONDITION "$work/err.txt" || { cat "$work/err.txt"; exit 1; }
    ;;
  closed_stream)
    loadgen --api=stream --stream_in_flight=3 --batch_size=2 --concurrency=2 --context_len=130 --steps=6 \
      --check_sequences=2 --out="$work/r.json"
    "$python" "$here/check_result.py" "$work/r.json" --api stream
    ;;
  closed_local)
    # Decodes through local channels (one per caller) with tensors in registered shared memory.
    loadgen --transport=local --tensors=system --batch_size=4 --concurrency=2 --lengths=uniform \
      --min_context_len=50 --max_context_len=400 --steps=8 --check_sequences=3 --out="$work/r.json"
    "$python" "$here/check_result.py" "$work/r.json" --transport local
    # Inline tensors cannot go through a local channel: refused before anything runs.
    rc=0
    loadgen --transport=local --steps=1 2>"$work/err.txt" || rc=$?
    [[ $rc == 2 ]] || { echo "expected exit 2 (bad flags) for --transport=local with inline tensors, got $rc"; exit 1; }
    grep -q "tensors=system or cuda" "$work/err.txt" || { cat "$work/err.txt"; exit 1; }
    # Timing on the caller's stream is for GPU-synchronised callers only.
    rc=0
    loadgen --transport=local --tensors=system --device_latency --steps=1 2>"$work/err.txt" || rc=$?
    [[ $rc == 2 ]] || { echo "expected exit 2 (bad flags) for --device_latency alone, got $rc"; exit 1; }
    grep -q "local_gpu_sync callers only" "$work/err.txt" || { cat "$work/err.txt"; exit 1; }
    ;;
  open_workload)
    loadgen --mode=open --rate=200 --arrival=fixed --lengths=workload \
      --workload_file="$here/small_workload.jsonl" --batch_size=1 --num_sequences=6 --steps=5 --decode_kv=false \
      --check_sequences=2 --out="$work/r.json"
    "$python" "$here/check_result.py" "$work/r.json"
    ;;
  sweep)
    loadgen --sweep_batch_sizes=1,3 --sweep_context_lens=64,200 --steps=3 --check_sequences=1 \
      --out="$work/sweep.json"
    "$python" "$here/check_result.py" "$work/sweep.json" --sweep 4
    # plot.py needs matplotlib to run; here only its syntax is checked.
    "$python" -c 'import ast, sys; ast.parse(open(sys.argv[1]).read())' "$src/client/loadgen/plot.py"
    ;;
  shape_fp8)
    shape="32/8/128, pages of 16, bf16, kv fp8_e4m3"
    loadgen --batch_size=3 --concurrency=2 --lengths=uniform --min_context_len=10 --max_context_len=150 \
      --steps=4 --check_sequences=3 --out="$work/r.json"
    "$python" "$here/check_result.py" "$work/r.json" --shape "$shape"
    # The recorded workload is in pages of 64 (its name says so), read as such for pages of 16.
    loadgen --lengths=workload --workload_file="$src/kernels/bench/workloads/gqa_paged_decode_h24_kv4_d128_ps64.jsonl" \
      --max_workload_len=300 --batch_size=2 --steps=3 --check_sequences=2 --out="$work/w.json"
    "$python" "$here/check_result.py" "$work/w.json" --shape "$shape"
    ;;
  shape_fp16_d256)
    # Tensors in registered shared memory, decoded through local channels, sized for this shape.
    loadgen --transport=local --tensors=system --batch_size=3 --concurrency=2 --lengths=uniform \
      --min_context_len=10 --max_context_len=150 --steps=4 --check_sequences=3 --out="$work/r.json"
    "$python" "$here/check_result.py" "$work/r.json" --transport local --shape "16/8/256, pages of 32, fp16, kv fp16"
    ;;
  *)
    echo "unknown case $case"
    exit 2
    ;;
esac
# Everything released: the server holds no sequence afterwards.
"$python" - "$work" <<'PY'
import glob, json, sys
for path in glob.glob(sys.argv[1] + "/*.json"):
    doc = json.load(open(path))
    last = doc["points"][-1] if "points" in doc else doc
    # stats_after is read before the release; the release latencies prove it ran.
    assert last["latency"]["ReleaseSequence"]["count"] == last["config"]["num_sequences"], path
PY
echo PASS
