#!/usr/bin/env bash
# Builds with CUDA and bundles, for the GPU host (which has CUDA but no gRPC, Abseil or
# prometheus-cpp), what server/backend/device_e2e.sh runs: pagedattn-server, pagedattn-cli,
# pagedattn-loadgen, pagedattn-health and the gpu-labelled test binaries, with the shared
# libraries they need (server/backend/bundle_executables.sh), debug info stripped.
#   usage: server/backend/make_device_bundle.sh [BUILD_DIR [BUNDLE_DIR]]
#          (defaults build-cuda and .device/bundle; .device/ is git-ignored)
# Environment: JOBS (default 2); SRC (source tree, default this checkout: to bundle exactly the
# committed HEAD while others edit the tree, `git worktree add /tmp/pa-head HEAD` and set
# SRC=/tmp/pa-head with a BUILD_DIR of its own). Then carry BUNDLE_DIR in the device run.
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build-cuda}
bundle=${2:-.device/bundle}
jobs=${JOBS:-2}

src=${SRC:-.}
cmake -S "$src" -B "$build" -DPAGEDATTN_ENABLE_CUDA=ON > "$build.configure.log" 2>&1 ||
  { cat "$build.configure.log"; exit 1; }
grep -q "pagedattn: CUDA kernels ON" "$build.configure.log" ||
  { echo "make_device_bundle: CUDA is not enabled in $build (nvcc missing?)" >&2; exit 1; }

required=(pagedattn-server pagedattn-cli pagedattn-health pagedattn_cuda_backend_test)
optional=(pagedattn-loadgen pagedattn_kernel_gpu_test pagedattn_cuda_staging_test
          pagedattn_cuda_ipc_test pagedattn_cuda_ipc_peer pagedattn_cuda_tiers_test
          pagedattn_cuda_tier_bench pagedattn_local_channel_gpu_test pagedattn-kernel-bench
          pagedattn_grpc_floor_bench)
targets=("${required[@]}")
available=$(cmake --build "$build" --target help | awk '{print $2}')
for t in "${optional[@]}"; do
  if grep -qx "$t" <<< "$available"; then targets+=("$t"); else echo "skipping $t (no such target)"; fi
done
cmake --build "$build" --target "${targets[@]}" -j"$jobs"

rm -rf "$bundle"
exes=()
for t in "${targets[@]}"; do exes+=("$build/bin/$t"); done
server/backend/bundle_executables.sh "$bundle" "${exes[@]}"
strip --strip-debug "$bundle"/bin/* "$bundle"/lib/* 2> /dev/null || true
du -sh "$bundle" | awk '{print "bundle after strip: " $1}'
ls "$bundle/bin"
