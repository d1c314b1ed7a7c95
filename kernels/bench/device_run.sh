#!/bin/bash
# The kernel on a GPU host in one run: GPU tests, benchmark, PyTorch baseline, merged table,
# compute-sanitizer.
# Run from the repository root on the GPU host with the binaries in .device/bin (built on a
# development machine: cmake -S . -B build-kernels -DPAGEDATTN_KERNELS_ONLY=ON; copy
# build-kernels/bin/* there), or set BIN. Logs go to $OUT (default /tmp/pagedattn-out).
# Steps: "tests bench torch sanitizer" by default; pass a subset as arguments. "shapes": the
# kernel on other model shapes (SHAPES, default all five; KV_DTYPES, default "auto fp8_e4m3"),
# each beside FlashInfer's batch decode when FI_BENCH names its harness binary and
# FI_WORKLOADS_PS16 its page-16 workload file (the recorded workloads converted to pages of 16,
# the same tokens per sequence); shapes_table.py merges them into $OUT/shapes.md.
set -u
OUT=${OUT:-/tmp/pagedattn-out}
BIN=${BIN:-.device/bin}
STEPS=${*:-tests bench torch sanitizer}
mkdir -p "$OUT"
export PAGEDATTN_WORKLOADS=$PWD/kernels/bench/workloads/gqa_paged_decode_h24_kv4_d128_ps64.jsonl
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw,temperature.gpu \
  --format=csv > "$OUT/smi.txt" 2>&1
has() { [[ " $STEPS " == *" $1 "* ]]; }
SMALL='*SequenceLengthsInTokens*:*EmptySequences*:*PagesShared*:*NanAndInf*:*RepeatedRuns*:*Graph*:*InFlight*:*PlanInto*'
if has tests; then
  echo "== tests"
  "$BIN/pagedattn_kernel_plan_test" --gtest_brief=1 > "$OUT/tests.log" 2>&1
  echo "plan test rc=$?" | tee -a "$OUT/tests.log"
  timeout 400 "$BIN/pagedattn_kernel_gpu_test" >> "$OUT/tests.log" 2>&1
  echo "gpu test rc=$?" | tee -a "$OUT/tests.log"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |FAILED|Failure|rc=" "$OUT/tests.log" | head -30
fi
if has bench; then
  echo "== bench"
  timeout 300 "$BIN/pagedattn-kernel-bench" --out "$OUT/bench.jsonl" ${BENCH_FLAGS:-} > "$OUT/bench.log" 2>&1
  echo "bench rc=$?" | tee -a "$OUT/bench.log"
fi
if has torch; then
  echo "== torch"
  timeout 300 python3 kernels/bench/torch_baseline.py --out "$OUT/torch.jsonl" >> "$OUT/bench.log" 2>&1
  echo "torch rc=$?" | tee -a "$OUT/bench.log"
fi
if has bench && has torch; then
  python3 kernels/bench/merge_results.py --bench "$OUT/bench.jsonl" --torch "$OUT/torch.jsonl" \
    --out "$OUT/h200.jsonl" > "$OUT/table.md" 2>&1
  cat "$OUT/table.md"
elif has bench; then
  cat "$OUT/bench.log"
fi
if has shapes; then
  echo "== shapes"
  for shape in ${SHAPES:-mixtral_tp2 llama8b llama70b_tp8 qwen7b gemma9b}; do
    for kv in ${KV_DTYPES:-auto fp8_e4m3}; do
      tag="${shape}_${kv}"
      timeout 500 "$BIN/pagedattn-kernel-bench" --shape "$shape" --kv-dtype "$kv" \
        --out "$OUT/shape_$tag.jsonl" ${SHAPE_FLAGS:-} > "$OUT/shape_$tag.log" 2>&1
      echo "$tag rc=$?" | tee -a "$OUT/shape_$tag.log"
      tail -1 "$OUT/shape_$tag.log"
      if [[ -n "${FI_BENCH:-}" ]]; then
        fi_kv=(); [[ "$kv" == fp8_e4m3 ]] && fi_kv=(--kv-dtype fp8_e4m3)
        fi_file=${FI_WORKLOADS_PS16:-}
        [[ "$shape" == mixtral_tp2 ]] && fi_file=$PAGEDATTN_WORKLOADS
        timeout 500 "$FI_BENCH" --shape "$shape" "${fi_kv[@]}" --max-pages-check 0 \
          --csv "$OUT/fi_$tag.csv" --workloads "$fi_file" > "$OUT/fi_$tag.log" 2>&1
        echo "fi $tag rc=$?" | tee -a "$OUT/fi_$tag.log"
      fi
    done
  done
  python3 kernels/bench/shapes_table.py "$OUT" > "$OUT/shapes.md" 2>&1
  cat "$OUT/shapes.md"
fi
if has sanitizer; then
  echo "== sanitizer"
  for tool in memcheck racecheck; do
    timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 \
      "$BIN/pagedattn_kernel_gpu_test" --gtest_filter="$SMALL" > "$OUT/sanitizer_$tool.log" 2>&1
    echo "$tool rc=$?" | tee -a "$OUT/sanitizer_$tool.log"
    tail -4 "$OUT/sanitizer_$tool.log"
  done
fi
