#!/bin/bash
# Device call 35 (2026-12-04): the full figures run with commit f55051c (the CUDA backend's GPU
# tests, the server, a CLI round trip, client/loadgen/run_h200.sh): client/loadgen/results/h200/.
SERVER_FLAGS="--num_layers=1 --max_batch_size=64 --max_queue_delay_us=0 --num_pages=200000" \
  server/backend/device_e2e.sh .device/bundle
