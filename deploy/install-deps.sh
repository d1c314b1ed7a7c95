#!/usr/bin/env bash
# Installs every Debian 12 (or Ubuntu 24.04) package that pagedattn needs to build and test.
# The one list of dependencies: the README, .ci/run and deploy/Dockerfile all call this script.
# Idempotent: packages already present are skipped by apt; the index is refreshed only when
# something is missing.
#   usage: deploy/install-deps.sh [--build-only]
#     --build-only   only what compiling needs (the Dockerfile's build stage)
set -euo pipefail

build_pkgs=(
  build-essential cmake pkg-config git
  libgrpc++-dev libgrpc-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler grpc-proto
  libabsl-dev prometheus-cpp-dev
  libgtest-dev libgmock-dev libbenchmark-dev
)
test_pkgs=(
  prometheus python3 python3-grpcio python3-protobuf
  docker-compose openssl curl procps
)

pkgs=("${build_pkgs[@]}")
if [[ "${1:-}" != "--build-only" ]]; then
  pkgs+=("${test_pkgs[@]}")
fi

missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#pkgs[@]} packages present"
  exit 0
fi

sudo=""
if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
$sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
echo "install-deps: installed ${missing[*]}"
