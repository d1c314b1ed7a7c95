#!/usr/bin/python3
"""Checks the deploy files against the real server.

Starts pagedattn-server on the CPU backend (loopback ports), drives it with pagedattn-cli
through a fixed scenario (successes, caller errors, a pool exhaustion), and then:
  --check=metrics    every pagedattn_* name that a dashboard query or an alert rule uses is
                     exported on /metrics (a renamed metric cannot silently blank a panel);
                     pagedattn-health answers as documented; SIGTERM drains and exits 0.
  --check=dashboard  a real Prometheus scraping the server (with the alert rules loaded)
                     answers every dashboard query with data and evaluates every rule cleanly.
Run by ctest (tests/deploy/CMakeLists.txt); needs /usr/bin/python3 with python3-yaml.
"""
import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

import yaml

METRIC_RE = re.compile(r"\bpagedattn_[a-zA-Z0-9_]+\b")
HEALTH_SERVICE = "pagedattn.v1.PagedAttention"


def fail(message):
    print(f"FAIL: {message}", file=sys.stderr)
    sys.exit(1)


def dashboard_queries(path):
    """(panel title, PromQL) for every target and query variable of a Grafana dashboard."""
    with open(path) as f:
        dash = json.load(f)
    queries = []

    def walk(panels):
        for panel in panels:
            for target in panel.get("targets", []):
                if target.get("expr"):
                    queries.append((panel.get("title", "?"), target["expr"]))
            walk(panel.get("panels", []))

    walk(dash.get("panels", []))
    for var in dash.get("templating", {}).get("list", []):
        query = var.get("query")
        if isinstance(query, dict):
            query = query.get("query")
        if var.get("type") == "query" and query:
            queries.append((f"variable {var['name']}", query))
    return queries


def rule_exprs(path):
    with open(path) as f:
        doc = yaml.safe_load(f)
    return [(r.get("alert") or r.get("record"), r["expr"])
            for g in doc["groups"] for r in g["rules"]]


def grafana_to_promql(expr):
    """A Grafana query as Prometheus evaluates it for 'All instances' over a 1m rate window."""
    expr = expr.replace("$__rate_interval", "1m").replace("${__rate_interval}", "1m")
    expr = re.sub(r"\$\{?instance\}?", ".*", expr)
    if "$" in expr:
        fail(f"query uses a variable this test does not substitute: {expr}")
    # label_values(metric, label) is Grafana's, not PromQL: ask for the metric itself.
    m = re.fullmatch(r"label_values\((\w+),\s*\w+\)", expr.strip())
    return m.group(1) if m else expr


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def exported_names(metrics_text):
    names = set()
    for line in metrics_text.splitlines():
        if line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


class Server:
    def __init__(self, binary, workdir):
        self.grpc = f"127.0.0.1:{free_port()}"
        self.metrics = f"127.0.0.1:{free_port()}"
        self.log = open(os.path.join(workdir, "server.log"), "w+")
        self.proc = subprocess.Popen(
            [binary, f"--grpc_address={self.grpc}", f"--metrics_address={self.metrics}",
             "--backend=cpu", "--num_pages=64", "--num_layers=2", "--cpu_threads=2",
             "--drain_timeout=5s"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def output(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                fail("server did not exit within 15 s of SIGTERM\n" + self.output())
        return self.proc.returncode


def run(cmd, expect_rc, what):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if r.returncode != expect_rc:
        fail(f"{what}: exit {r.returncode}, expected {expect_rc}: {' '.join(cmd)}\n"
             f"{r.stdout}{r.stderr}")
    return r


def wait_serving(health, server):
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            fail("server exited at start\n" + server.output())
        r = subprocess.run([health, f"--address={server.grpc}", "--timeout=1s"],
                           capture_output=True, text=True)
        if r.returncode == 0:
            return
        time.sleep(0.2)
    fail("server never answered SERVING\n" + server.output())


def scenario(cli, server, base):
    """Calls with known outcomes: OK on every method, caller errors, one pool exhaustion."""
    c = [cli, f"--target={server.grpc}", "--timeout=20s"]
    a, b, d, child = base + 1, base + 2, base + 3, base + 4
    run(c + ["config"], 0, "config")
    for sid in (a, b, d):
        run(c + ["create", str(sid)], 0, "create")
    run(c + ["append", str(a), "--num_tokens=100"], 0, "append")
    run(c + ["append", str(b), "--num_tokens=70"], 0, "append")
    run(c + ["append", str(d), "--num_tokens=1"], 0, "append")
    run(c + ["decode", f"{a},{b},{d}", "--with_kv"], 0, "decode step, batch of 3")
    run(c + ["decode", f"{a},{b}"], 0, "decode without k/v")
    run(c + ["fork", str(a), str(child)], 0, "fork")
    run(c + ["decode", str(child), "--with_kv"], 0, "decode of the fork")
    run(c + ["create", str(a)], 1, "create of an existing id (ALREADY_EXISTS)")
    run(c + ["decode", str(base + 99)], 1, "decode of an unknown id (NOT_FOUND)")
    # 5000 tokens need 79 pages per layer; the pool has 64: RESOURCE_EXHAUSTED, nothing changes.
    run(c + ["append", str(d), "--num_tokens=5000"], 1, "append beyond the pool")
    run(c + ["release", str(child)], 0, "release")
    run(c + ["release", str(child)], 1, "second release (NOT_FOUND)")
    run(c + ["stats"], 0, "stats")
    for sid in (a, b, d):
        run(c + ["release", str(sid)], 0, "release")


def referenced(args):
    refs = {}
    for title, expr in dashboard_queries(args.dashboard):
        for name in METRIC_RE.findall(expr):
            refs.setdefault(name, set()).add(f"dashboard panel '{title}'")
    for rules in args.rules:
        for alert, expr in rule_exprs(rules):
            for name in METRIC_RE.findall(expr):
                refs.setdefault(name, set()).add(f"rule {alert} ({os.path.basename(rules)})")
    # Guards the parsing itself: the dashboard and rules use a dozen names and more.
    if len(refs) < 10:
        fail(f"found only {len(refs)} metric names in the dashboard and rules: {sorted(refs)}")
    return refs


def check_metrics(args, server):
    refs = referenced(args)
    scenario(args.cli, server, 1000)
    names = exported_names(http_get(f"http://{server.metrics}/metrics"))
    missing = {n: where for n, where in refs.items() if n not in names}
    for name, where in sorted(missing.items()):
        print(f"missing on /metrics: {name}, used by {', '.join(sorted(where))}", file=sys.stderr)
    if missing:
        fail(f"{len(missing)} metric name(s) used by the dashboard or rules are not exported")
    print(f"all {len(refs)} metric names used by the dashboard and rules are exported:")
    for name in sorted(refs):
        print(f"  {name}")

    h = [args.health, f"--address={server.grpc}", "--timeout=2s"]
    run(h, 0, "health of the server")
    run(h + [f"--service={HEALTH_SERVICE}"], 0, "health of the decode service")
    r = run(h + ["--service=no.such.Service"], 1, "health of an unknown service")
    if "NOT_FOUND" not in r.stderr:
        fail(f"an unknown service should report NOT_FOUND: {r.stderr}")

    rc = server.stop()
    if rc != 0:
        fail(f"server exited {rc} after SIGTERM\n" + server.output())
    r = run(h, 1, "health after shutdown")
    if "UNAVAILABLE" not in r.stderr:
        fail(f"a stopped server should report UNAVAILABLE: {r.stderr}")
    print("pagedattn-health: SERVING, NOT_FOUND and UNAVAILABLE as documented; drain exit 0")


def prometheus_query(base, promql):
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        body = json.loads(http_get(url))
    except urllib.error.HTTPError as e:
        return "error", e.read().decode()
    if body.get("status") != "success":
        return "error", body.get("error", body)
    return "ok", body["data"]["result"]


def check_dashboard(args, server, workdir):
    port = free_port()
    config = os.path.join(workdir, "prometheus.yml")
    with open(config, "w") as f:
        yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [os.path.abspath(r) for r in args.rules],
            "scrape_configs": [{"job_name": "pagedattn",
                                "static_configs": [{"targets": [server.metrics]}]}],
        }, f)
    log = open(os.path.join(workdir, "prometheus.log"), "w+")
    prom = subprocess.Popen(
        [args.prometheus, f"--config.file={config}",
         f"--storage.tsdb.path={os.path.join(workdir, 'tsdb')}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        # Traffic before and after Prometheus's first scrapes, so counters move between samples.
        scenario(args.cli, server, 1000)
        deadline = time.monotonic() + 60
        while True:
            status, result = prometheus_query(base, 'up{job="pagedattn"}')
            if status == "ok" and result and result[0]["value"][1] == "1":
                break
            if prom.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                fail("Prometheus never scraped the server\n" + log.read()[-3000:])
            time.sleep(0.5)
        time.sleep(2)
        scenario(args.cli, server, 2000)

        queries = dashboard_queries(args.dashboard)
        deadline = time.monotonic() + 45
        while True:
            empty, errors = [], []
            for title, expr in queries:
                status, result = prometheus_query(base, grafana_to_promql(expr))
                if status != "ok":
                    errors.append(f"'{title}': {result}\n    {expr}")
                elif not result:
                    empty.append(f"'{title}': {expr}")
            if errors:
                fail("dashboard queries Prometheus rejects:\n  " + "\n  ".join(errors))
            if not empty:
                break
            if time.monotonic() > deadline:
                fail("dashboard queries with no data after real traffic:\n  " + "\n  ".join(empty))
            time.sleep(1)
        print(f"all {len(queries)} dashboard queries return data")

        deadline = time.monotonic() + 30
        while True:
            groups = json.loads(http_get(f"{base}/api/v1/rules"))["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            bad = [f"{r['name']}: {r.get('lastError')}" for r in rules if r["health"] == "err"]
            if bad:
                fail("rules that fail to evaluate:\n  " + "\n  ".join(bad))
            if rules and all(r["health"] == "ok" for r in rules):
                break
            if time.monotonic() > deadline:
                fail(f"rules not evaluated within 30 s: {[(r['name'], r['health']) for r in rules]}")
            time.sleep(1)
        print(f"all {len(rules)} alert rules evaluate cleanly against the live server")
    finally:
        prom.terminate()
        try:
            prom.wait(timeout=15)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", choices=["metrics", "dashboard"], required=True)
    p.add_argument("--server", required=True)
    p.add_argument("--cli", required=True)
    p.add_argument("--health", required=True)
    p.add_argument("--dashboard", required=True)
    p.add_argument("--rules", action="append", required=True)
    p.add_argument("--prometheus", default="prometheus")
    args = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="pagedattn-deploy-") as workdir:
        server = Server(args.server, workdir)
        try:
            wait_serving(args.health, server)
            if args.check == "metrics":
                check_metrics(args, server)
            else:
                check_dashboard(args, server, workdir)
        finally:
            server.stop()
    print("PASS")


if __name__ == "__main__":
    main()
