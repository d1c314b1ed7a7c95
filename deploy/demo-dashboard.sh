#!/usr/bin/env bash
# Makes deploy/dashboard.png from a real local run: pagedattn-server (CPU backend) and a
# Prometheus on loopback ports, deploy/demo-load.py driving the server with pagedattn-cli,
# then deploy/render-dashboard.py drawing the dashboard's panels from Prometheus.
#   deploy/demo-dashboard.sh [BUILD_DIR] [MINUTES]      (default: build 8)
# Needs the project's packages (deploy/install-deps.sh) and, for the drawing only,
# python3-matplotlib: apt-get install -y --no-install-recommends python3-matplotlib
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build}"
minutes="${2:-8}"
work="$(mktemp -d)"
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

grpc=127.0.0.1:50151 metrics=127.0.0.1:9564 prom=127.0.0.1:9190
"$build/bin/pagedattn-server" --grpc_address=$grpc --metrics_address=$metrics --backend=cpu \
  --num_pages=320 --num_layers=2 --cpu_threads=2 --max_batch_size=64 >"$work/server.log" 2>&1 &
pids+=($!)
cat >"$work/prometheus.yml" <<YAML
global: {scrape_interval: 2s, evaluation_interval: 2s}
rule_files: [$PWD/deploy/prometheus/rules/pagedattn.rules.yml]
scrape_configs:
  - job_name: pagedattn
    static_configs: [{targets: ["$metrics"]}]
YAML
prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
  --web.listen-address=$prom >"$work/prometheus.log" 2>&1 &
pids+=($!)
for _ in $(seq 50); do
  "$build/bin/pagedattn-health" --address=$grpc >/dev/null 2>&1 && break
  sleep 0.2
done
"$build/bin/pagedattn-health" --address=$grpc

/usr/bin/python3 deploy/demo-load.py --cli="$build/bin/pagedattn-cli" --target=$grpc \
  --minutes="$minutes" &
load=$!
pids+=($load)
# Draw while the last phase still runs, so the gauges show a live server.
sleep "$(/usr/bin/python3 -c "print(max(10, $minutes * 60 - 15))")"
/usr/bin/python3 deploy/render-dashboard.py --prometheus=http://$prom --minutes="$minutes" \
  --rate-interval=30s --out=deploy/dashboard.png
wait $load
