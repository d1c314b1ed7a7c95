#!/usr/bin/env bash
# Installs every Debian 12 (or Ubuntu 24.04) package that pagedattn needs to build and test.
# The one list of dependencies: the README, .ci/run and deploy/Dockerfile all call this script.
# Idempotent: packages already present are skipped by apt; the index is refreshed only when
# something is missing.
#   usage: deploy/install-deps.sh [--build-only | --runtime]
#     (none)         build, test and deploy-check tools
#     --build-only   only what compiling needs (the Dockerfile's build stage)
#     --runtime      only the shared libraries that pagedattn-server, pagedattn-cli and
#                    pagedattn-health load (the Dockerfile's runtime stage)
set -euo pipefail

mode="${1:-}"
case "$mode" in
  ""|--build-only|--runtime) ;;
  *) echo "usage: $0 [--build-only | --runtime]" >&2; exit 2 ;;
esac

build_pkgs=(
  build-essential cmake pkg-config git
  libgrpc++-dev libgrpc-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler grpc-proto
  libabsl-dev prometheus-cpp-dev
  libgtest-dev libgmock-dev libbenchmark-dev
)
test_pkgs=(
  prometheus python3 python3-grpcio python3-protobuf python3-yaml
  python3-numpy python3-venv python3-setuptools python3-wheel
  docker-compose openssl curl procps clang libclang-rt-dev
  nodejs
)
# The deploy checks (tests/deploy) install their npm packages from deploy/lint's lockfile.
# Debian's nodejs comes without npm; NodeSource's bundles it (and conflicts with Debian's npm).
command -v npm >/dev/null 2>&1 || test_pkgs+=(npm)

# The runtime libraries (their own dependencies come with them). Ubuntu 24.04 renamed several
# for the 64-bit time_t transition.
. /etc/os-release
case "${VERSION_CODENAME:-}" in
  bookworm) runtime_pkgs=(libgrpc++1.51 libprotobuf32 libabsl20220623) ;;
  noble) runtime_pkgs=(libgrpc++1.51t64 libprotobuf32t64 libabsl20220623t64) ;;
  *)
    if [[ "$mode" == --runtime ]]; then
      echo "install-deps: --runtime knows Debian 12 (bookworm) and Ubuntu 24.04 (noble)," \
           "not '${VERSION_CODENAME:-unknown}'" >&2
      exit 1
    fi
    runtime_pkgs=() ;;
esac
runtime_pkgs+=(libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0)

case "$mode" in
  --runtime) pkgs=("${runtime_pkgs[@]}") ;;
  --build-only) pkgs=("${build_pkgs[@]}") ;;
  *) pkgs=("${build_pkgs[@]}" "${test_pkgs[@]}") ;;
esac

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
