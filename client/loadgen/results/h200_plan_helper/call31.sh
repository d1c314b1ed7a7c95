#!/bin/bash
# Device call 31 (2026-12-04): PERF.md entry 12, the replay path priced before it is built.
# Built here: cmake -S . -B build-kernels -DPAGEDATTN_KERNELS_ONLY=ON && cmake --build build-kernels -j2
# (commit c1a12e5); run with carry ["build-kernels/bin"]. Output: call31_launch_sequence.log.
BIN=build-kernels/bin BENCH_FLAGS="--launch-sequence --no-floors --no-cpasync --iters 20" \
  kernels/bench/device_run.sh bench
