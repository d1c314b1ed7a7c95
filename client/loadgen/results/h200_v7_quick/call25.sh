#!/usr/bin/env bash
# Device call 25 (2026-12-04): the CUDA backend's GPU tests and a QUICK figures run with the v7
# kernel defaults (merge kernel on counters, V tails zeroed in registers). Bundle made here with
#   JOBS=2 server/backend/make_device_bundle.sh build .device/bundle
# and carried as .device/bundle. Short runs (QUICK=1): correctness and a smoke of the figures,
# not a replacement of the full run in ../h200/ (kernel v6, device call 20).
SERVER_FLAGS="--num_layers=1 --max_batch_size=64 --max_queue_delay_us=0 --num_pages=200000" \
  QUICK=1 LOADGEN_TIMEOUT=280 TEST_TIMEOUT=120 server/backend/device_e2e.sh .device/bundle
