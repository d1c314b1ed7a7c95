#!/bin/bash
# Device call 39 (2026-12-04): the full figures run with commit 82b9572 (the GPU tests of the
# kernel, the CUDA backend and the engine on it, the server, a CLI round trip,
# client/loadgen/run_h200.sh): client/loadgen/results/h200/.
KERNEL_TESTS=1 SERVER_FLAGS="--num_layers=1 --max_batch_size=64 --max_queue_delay_us=0 --num_pages=200000" \
  server/backend/device_e2e.sh .device/bundle
