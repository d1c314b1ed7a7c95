#!/usr/bin/env bash
# Builds the pagedattn image with a local Docker engine.
#   deploy/build-image.sh cpu     pagedattn:cpu, both stages on a Debian 12 base (CPU backend)
#   deploy/build-image.sh cuda    pagedattn:cuda, on NVIDIA's CUDA 13.0 images (the defaults)
#   deploy/build-image.sh prometheus   pagedattn-prometheus:local (Debian's prometheus package)
#   deploy/build-image.sh engine  only make sure an engine answers (install/start it as root)
#   deploy/build-image.sh base    only make sure the Debian 12 base image exists
#   deploy/build-image.sh prune   remove dangling images (the build stages of earlier builds)
#   deploy/build-image.sh engine-stop   stop the engine this script started (if it did)
# With no engine answering, it installs Debian's docker.io (as root) and starts dockerd in the
# background, recording its pid in $PAGEDATTN_DOCKERD_PIDFILE (default
# /run/pagedattn-dockerd.pid) so that `engine-stop` stops that one and nothing else.
# The CPU base is $PAGEDATTN_CPU_BASE (default pagedattn-base:bookworm). When that image is
# absent and no registry has it, the script makes it with debootstrap from the host's Debian
# mirror (needs root; about 30 s to 90 s) and imports it.
# The docker client is $DOCKER, or the first of /usr/bin/docker and `docker` on PATH whose API
# the engine accepts. Environment: BUILD_JOBS (compile jobs, default all CPUs).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
what=${1:-}
cpu_base=${PAGEDATTN_CPU_BASE:-pagedattn-base:bookworm}
cuda_build_base=nvidia/cuda:13.0.0-devel-ubuntu24.04
cuda_runtime_base=nvidia/cuda:13.0.0-runtime-ubuntu24.04
pidfile=${PAGEDATTN_DOCKERD_PIDFILE:-/run/pagedattn-dockerd.pid}
log() { echo "build-image: $*" >&2; }
die() { log "$*"; exit 1; }
as_root() { if [[ $(id -u) -eq 0 ]]; then "$@"; else sudo -n "$@"; fi; }
# apt-get install, refreshing the index only when the first try fails.
apt_install() {
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null && return 0
  as_root apt-get update -q >/dev/null
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null
}

# The first client that talks to the running engine (a newer client than the engine negotiates
# down, but only to the API versions it still supports).
pick_client() {
  local c
  for c in ${DOCKER:-} /usr/bin/docker "$(command -v docker || true)"; do
    [[ -n $c && -x $c ]] || continue
    if "$c" version --format '{{.Server.APIVersion}}' >/dev/null 2>&1; then
      DOCKER=$c
      return 0
    fi
  done
  return 1
}

ensure_engine() {
  pick_client && return 0
  if [[ $(id -u) -ne 0 ]] && ! sudo -n true 2>/dev/null; then
    die "no Docker engine answers and starting one needs root (run as root, or start dockerd)"
  fi
  if ! command -v dockerd >/dev/null 2>&1; then
    log "installing Debian's docker.io"
    apt_install docker.io
  fi
  log "starting dockerd (log: /var/log/pagedattn-dockerd.log)"
  as_root sh -c "dockerd >/var/log/pagedattn-dockerd.log 2>&1 & echo \$! > '$pidfile'"
  local i
  for i in $(seq 60); do
    # Once one client answers, pick again: the engine may have come up between two candidates,
    # and the first in the list is the one wanted.
    if pick_client; then
      pick_client
      log "engine up (pid $(cat "$pidfile"), client $DOCKER)"
      return 0
    fi
    sleep 1
  done
  die "dockerd did not answer within 60 s; see /var/log/pagedattn-dockerd.log"
}

stop_engine() {
  [[ -f $pidfile ]] || { log "no engine started by this script ($pidfile absent)"; return 0; }
  local pid
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then
    log "stopping dockerd (pid $pid)"
    as_root kill -TERM "$pid"
    for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -0 "$pid" 2>/dev/null && die "dockerd (pid $pid) still running after 30 s"
  fi
  as_root rm -f "$pidfile"
}

debian_mirror() {
  local m=""
  if [[ -f /etc/apt/sources.list.d/debian.sources ]]; then
    m=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources)
  fi
  if [[ -z $m && -f /etc/apt/sources.list ]]; then
    m=$(awk '$1 == "deb" && $0 ~ /debian/ {print $2; exit}' /etc/apt/sources.list)
  fi
  echo "${m:-http://deb.debian.org/debian}"
}

ensure_base() {
  "$DOCKER" image inspect "$cpu_base" >/dev/null 2>&1 && return 0
  if [[ $cpu_base != pagedattn-base:* ]]; then
    "$DOCKER" pull "$cpu_base" && return 0
    die "base image $cpu_base is not present and cannot be pulled"
  fi
  if [[ $(id -u) -ne 0 ]]; then die "making $cpu_base with debootstrap needs root"; fi
  command -v debootstrap >/dev/null 2>&1 || { log "installing debootstrap"; apt_install debootstrap; }
  local dir mirror started=$SECONDS
  dir=$(mktemp -d /var/tmp/pagedattn-base.XXXXXX)
  mirror=$(debian_mirror)
  log "making $cpu_base: debootstrap --variant=minbase bookworm from $mirror"
  if ! debootstrap --variant=minbase bookworm "$dir" "$mirror" >"$dir.log" 2>&1; then
    tail -20 "$dir.log" >&2
    rm -rf "$dir" "$dir.log"
    die "debootstrap failed"
  fi
  tar -C "$dir" -c . | "$DOCKER" import - "$cpu_base" >/dev/null
  rm -rf "$dir" "$dir.log"
  log "made $cpu_base in $((SECONDS - started)) s"
}

build() {  # build TAG BUILD_BASE RUNTIME_BASE
  local started=$SECONDS
  log "building $1 (build stage on $2, runtime stage on $3)"
  "$DOCKER" build -f "$root/deploy/Dockerfile" -t "$1" \
    --build-arg "BUILD_BASE=$2" --build-arg "RUNTIME_BASE=$3" \
    --build-arg "BUILD_JOBS=${BUILD_JOBS:-}" "$root"
  log "built $1 in $((SECONDS - started)) s: $("$DOCKER" image inspect -f '{{.Size}}' "$1") bytes"
}

case $what in
  engine) ensure_engine ;;
  engine-stop) stop_engine ;;
  prune) pick_client || die "no Docker engine answers"; "$DOCKER" image prune -f ;;
  base) ensure_engine; ensure_base ;;
  cpu) ensure_engine; ensure_base; build pagedattn:cpu "$cpu_base" "$cpu_base" ;;
  prometheus)
    ensure_engine; ensure_base
    "$DOCKER" build -t pagedattn-prometheus:local --build-arg "PROMETHEUS_BASE=$cpu_base" \
      "$root/deploy/prometheus"
    ;;
  cuda)
    ensure_engine
    for image in "$cuda_build_base" "$cuda_runtime_base"; do
      "$DOCKER" image inspect "$image" >/dev/null 2>&1 && continue
      if ! "$DOCKER" pull "$image"; then
        die "the CUDA base image $image is not present and cannot be pulled (no registry" \
            "reachable?): pagedattn:cuda cannot be built on this machine." \
            "Load it (docker load) or build where Docker Hub is reachable."
      fi
    done
    build pagedattn:cuda "$cuda_build_base" "$cuda_runtime_base"
    ;;
  *)
    echo "usage: $0 cpu | cuda | prometheus | engine | base | prune | engine-stop" >&2
    exit 2
    ;;
esac
