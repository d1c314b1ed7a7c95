#!/usr/bin/env bash
# The CUDA backend end to end on a GPU host, in one run. Run from the repository root
# there, with the bundle made here by server/backend/make_device_bundle.sh:
#   server/backend/device_e2e.sh [BUNDLE]          (default .device/bundle)
# Steps, in order (STEPS, default "tests server loadgen"):
#   tests    the CUDA backend's test binaries (staging unit test, GPU test against the CPU
#            backend and the engine, registered memory over CUDA IPC, the KV tiers' page
#            transfers, the local channel with cuda regions); with KERNEL_TESTS=1 also the
#            kernel's GPU test (long)
#   tiers    the offload/restore and migration bench of a 32K-token sequence next to pinned
#            cudaMemcpy (tier_bench.log), then a migration of one between two CUDA servers on
#            this GPU over gRPC, by bytes, through a shared-memory region and through a cuda
#            region (pagedattn-cli migrate --repeat=10 [--via_region [--region_device=0]],
#            migrate.log), and gRPC's own time for 64 MiB down and up a stream
#            (pagedattn_grpc_floor_bench stream)
#   server   pagedattn-server --backend=cuda (pool sized by --gpu_memory_fraction), its health
#            probe, a CLI round trip and a small loadgen run with the reference check; the
#            server stays up for the next step
#   loadgen  client/loadgen/run_h200.sh (the reference figures) against that server
# Then a last health probe, SIGTERM and the server's exit status. Logs go to $OUT (default
# /tmp/pagedattn-e2e), a few files: e2e.log (summary: GPU,
# each step's result, server metrics), tests.log, server.log, smoke.json, and from run_h200.sh
# figures.md, summary.txt, sweep.png and loadgen.tar.gz (its whole output folder).
# Environment: SERVER_FLAGS (server flags; default one layer, batches of 64, no batching
# delay, as run_h200.sh asks), QUICK=1 (short loadgen runs), LOADGEN_TIMEOUT (s, default 420),
# TEST_TIMEOUT (s per test binary, default 300), SMOKE_ARGS (shape of the small loadgen run),
# MIG_FLAGS (more flags for the tiers step's two servers, e.g. --export_piece_mib=0), MPS=1
# (every step under an MPS control daemon started here: one GPU context for all the processes,
# as docs/operations.md recommends for replicas and GPU callers sharing a GPU).
set -u
BUNDLE=$(cd "${1:-.device/bundle}" && pwd) || { echo "no bundle" >&2; exit 2; }
BIN=$BUNDLE/bin
OUT=${OUT:-/tmp/pagedattn-e2e}
STEPS=${STEPS:-tests server loadgen}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$BUNDLE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PAGEDATTN_SERVER_BIN=$BIN/pagedattn-server  # for the tests that start a server
export PAGEDATTN_WORKLOADS=$PWD/kernels/bench/workloads/gqa_paged_decode_h24_kv4_d128_ps64.jsonl
export PYTHONUNBUFFERED=1
LOG=$OUT/e2e.log
has() { [[ " $STEPS " == *" $1 "* ]]; }
say() { echo "$*" | tee -a "$LOG"; }
: > "$LOG"
failures=0
check() {  # check NAME RC
  if [[ $2 -eq 0 ]]; then say "ok   $1"; else say "FAIL $1 (rc=$2)"; failures=$((failures + 1)); fi
}

if [[ ${MPS:-0} == 1 ]]; then
  source "$(dirname "$0")/mps.sh"
  start_mps || exit 2
  say "$MPS_LINE"
fi

nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.mem \
  --format=csv >> "$LOG" 2>&1
say "bundle: $(ls "$BIN" | tr '\n' ' ')"

if has tests; then
  say "== tests"
  : > "$OUT/tests.log"
  # pagedattn_cuda_ipc_test finds its peer process beside it in the bundle.
  tests=(pagedattn_cuda_staging_test pagedattn_cuda_backend_test pagedattn_cuda_ipc_test
         pagedattn_cuda_tiers_test pagedattn_local_channel_gpu_test)
  [[ ${KERNEL_TESTS:-0} == 1 ]] && tests+=(pagedattn_kernel_gpu_test)
  for t in "${tests[@]}"; do
    [[ -x $BIN/$t ]] || { say "skip $t (not in the bundle)"; continue; }
    timeout "${TEST_TIMEOUT:-300}" "$BIN/$t" --gtest_brief=1 > "$OUT/test.tmp" 2>&1
    rc=$?
    { echo "=== $t (rc=$rc)"; cat "$OUT/test.tmp"; } >> "$OUT/tests.log"
    check "$t" $rc
    grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED  \]" "$OUT/test.tmp" | sort -u >> "$LOG"
    rm -f "$OUT/test.tmp"
  done
fi

if has tiers; then
  say "== tiers"
  if [[ -x $BIN/pagedattn_cuda_tier_bench ]]; then
    timeout "${TEST_TIMEOUT:-300}" "$BIN/pagedattn_cuda_tier_bench" 32768 1 20 > "$OUT/tier_bench.log" 2>&1
    check pagedattn_cuda_tier_bench $?
    cat "$OUT/tier_bench.log" >> "$LOG"
  else
    say "skip pagedattn_cuda_tier_bench (not in the bundle)"
  fi
  # Two servers on this GPU, a 32K-token sequence of one layer on the first, migrated to the
  # second ten times each way the CLI offers (the copy released between runs).
  : > "$OUT/migrate.log"
  # shellcheck disable=SC2206  # MIG_FLAGS is split into flags on purpose
  mig_flags=(--backend=cuda --num_layers=1 --num_pages=1024 --host_kv_bytes=0
             --max_message_bytes=134217728 --metrics_address=127.0.0.1:0 --grpc_address=127.0.0.1:0
             ${MIG_FLAGS:-})
  mig_pids=(); mig_targets=(); mig_metrics=()
  for i in 0 1; do
    "$BIN/pagedattn-server" "${mig_flags[@]}" > "$OUT/migrate_server$i.log" 2>&1 &
    mig_pids+=($!)
    line=
    for _ in $(seq 1 120); do
      line=$(grep -m1 "serving grpc=" "$OUT/migrate_server$i.log" 2> /dev/null) && break
      sleep 0.5
    done
    mig_targets+=("$(sed -E 's/.*grpc=([^ ]+).*/\1/' <<< "$line")")
    mig_metrics+=("$(sed -E 's/.*metrics=([^ ]+).*/\1/' <<< "$line")")
  done
  # The exporter's ExportSequence and the importer's ImportSequence time so far (sums and
  # counts of the servers' request histograms): where a migration's time goes.
  mig_rpcs() {
    python3 - "$1" "${mig_metrics[@]}" << 'EOF2'
import re, sys, urllib.request
def rpc(address, method):
    text = urllib.request.urlopen("http://%s/metrics" % address, timeout=5).read().decode()
    got = {}
    for kind in ("sum", "count"):
        m = re.search(r'pagedattn_request_duration_seconds_%s\{[^}]*method="%s"[^}]*\} (\S+)' % (kind, method), text)
        got[kind] = float(m.group(1)) if m else 0.0
    return got
e, i = rpc(sys.argv[2], "ExportSequence"), rpc(sys.argv[3], "ImportSequence")
print("rpcs after %s: export %d calls %.3f ms in all, import %d calls %.3f ms in all" %
      (sys.argv[1], e["count"], e["sum"] * 1e3, i["count"], i["sum"] * 1e3))
EOF2
  }
  mcli() { "$BIN/pagedattn-cli" --max_message_bytes=134217728 --target="${mig_targets[0]}" "$@"; }
  {
    mcli create 1 && mcli append 1 --num_tokens=32768 &&
      mcli migrate 1 "${mig_targets[1]}" --repeat=10 && mig_rpcs "by bytes" &&
      "$BIN/pagedattn-cli" --target="${mig_targets[1]}" release 1 &&
      mcli migrate 1 "${mig_targets[1]}" --repeat=10 --via_region && mig_rpcs "system region" &&
      "$BIN/pagedattn-cli" --target="${mig_targets[1]}" release 1 &&
      mcli migrate 1 "${mig_targets[1]}" --repeat=10 --via_region --region_device=0 &&
      mig_rpcs "cuda region"
  } >> "$OUT/migrate.log" 2>&1
  check "migrate between two servers (bytes, system region, cuda region)" $?
  # gRPC's own price of the bytes' two hops (down from the exporter, up to the importer).
  if [[ -x $BIN/pagedattn_grpc_floor_bench ]]; then
    timeout 120 "$BIN/pagedattn_grpc_floor_bench" 2000 stream >> "$OUT/migrate.log" 2>&1
    check "gRPC stream floor" $?
  fi
  grep -E "median|region .* registered|stream|to server|to client|^rpcs" "$OUT/migrate.log" >> "$LOG"
  kill -TERM "${mig_pids[@]}" 2> /dev/null
  wait "${mig_pids[@]}" 2> /dev/null
fi

server_pid=
grpc=
metrics=
start_server() {
  # shellcheck disable=SC2086
  "$BIN/pagedattn-server" --backend=cuda --grpc_address=127.0.0.1:0 \
    --metrics_address=127.0.0.1:0 \
    ${SERVER_FLAGS:---num_layers=1 --max_batch_size=64 --max_queue_delay_us=0} \
    > "$OUT/server.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 1 300); do
    line=$(grep -m1 "serving grpc=" "$OUT/server.log" 2> /dev/null) && break
    kill -0 "$server_pid" 2> /dev/null || break
    sleep 0.5
  done
  if [[ -z ${line:-} ]]; then
    say "FAIL server did not start:"; tail -5 "$OUT/server.log" | tee -a "$LOG"
    failures=$((failures + 1)); server_pid=; return 1
  fi
  grpc=$(sed -E 's/.*grpc=([^ ]+).*/\1/' <<< "$line")
  metrics=$(sed -E 's/.*metrics=([^ ]+).*/\1/' <<< "$line")
  grep "pagedattn-server:" "$OUT/server.log" | head -3 >> "$LOG"
}
stop_server() {
  [[ -n $server_pid ]] || return 0
  kill -TERM "$server_pid"
  for _ in $(seq 1 60); do kill -0 "$server_pid" 2> /dev/null || break; sleep 0.5; done
  if kill -0 "$server_pid" 2> /dev/null; then
    say "FAIL server still running 30 s after SIGTERM"; kill -KILL "$server_pid"
    failures=$((failures + 1))
  fi
  wait "$server_pid"
  check "server exit status after SIGTERM" $?
  tail -2 "$OUT/server.log" >> "$LOG"
  server_pid=
}
scrape() {
  python3 - "$metrics" << 'EOF' >> "$LOG" 2>&1
import sys, urllib.request
text = urllib.request.urlopen("http://%s/metrics" % sys.argv[1], timeout=5).read().decode()
for line in text.splitlines():
    if line.startswith("pagedattn_") and ("_sum" in line or "_count" in line or "{" not in line):
        print("  " + line)
EOF
}

if has server; then
  say "== server"
  if start_server; then
    "$BIN/pagedattn-health" --address="$grpc" --timeout=5s >> "$LOG" 2>&1
    check "health SERVING" $?
    cli() { "$BIN/pagedattn-cli" --target="$grpc" "$@" >> "$LOG" 2>&1; }
    cli config && cli create 7 && cli append 7 --num_tokens=300 &&
      cli decode 7 --with_kv && cli fork 7 8 && cli decode 7,8 --with_kv && cli stats &&
      cli release 7 && cli release 8
    check "cli create/append/decode/fork/release" $?
    if [[ -x $BIN/pagedattn-loadgen ]]; then
      timeout 180 "$BIN/pagedattn-loadgen" --target="$grpc" --metrics_address="$metrics" \
        ${SMOKE_ARGS:---batch_size=64 --context_len=4096 --steps=50 --warmup_steps=5} \
        --check_sequences=8 --out="$OUT/smoke.json" >> "$LOG" 2>&1
      check "loadgen smoke with the reference check" $?
    fi
    scrape
  fi
fi

if has loadgen; then
  say "== loadgen"
  if [[ ! -x client/loadgen/run_h200.sh ]]; then
    say "skip: client/loadgen/run_h200.sh not present"
  else
    [[ -z $server_pid ]] && start_server
    if [[ -n $server_pid ]]; then
      TARGET=$grpc METRICS=$metrics LOADGEN=$BIN/pagedattn-loadgen QUICK=${QUICK:-0} \
        timeout "${LOADGEN_TIMEOUT:-420}" client/loadgen/run_h200.sh "$OUT/loadgen" >> "$LOG" 2>&1
      check "client/loadgen/run_h200.sh" $?
      for f in figures.md summary.txt sweep.png; do
        [[ -f $OUT/loadgen/$f ]] && cp "$OUT/loadgen/$f" "$OUT/"
      done
      tar -czf "$OUT/loadgen.tar.gz" -C "$OUT" loadgen && rm -rf "$OUT/loadgen"
      scrape
    fi
  fi
fi

if [[ -n $server_pid ]]; then
  "$BIN/pagedattn-health" --address="$grpc" --timeout=5s >> "$LOG" 2>&1
  check "health still SERVING at the end" $?
  stop_server
fi
say "== $failures failure(s)"
exit $((failures > 0))
