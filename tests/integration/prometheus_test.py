"""A real Prometheus server scrapes the real pagedattn-server's /metrics while pagedattn-cli
makes decodes; its query API must then answer pagedattn_batch_size_count (> 0, at most the
batches the server reports), the sequences decoded, and the Decode calls by method and code.

usage: /usr/bin/python3 prometheus_test.py --server=BIN --cli=BIN --prometheus=BIN
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pagedattn_testing as t  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def query(port, expr):
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.load(r)
    except OSError:
        return None
    if body.get("status") != "success" or not body["data"]["result"]:
        return None
    return float(body["data"]["result"][0]["value"][1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--server", required=True)
    p.add_argument("--cli", required=True)
    p.add_argument("--prometheus", required=True)
    args = p.parse_args()

    with t.Server(args.server, ["--num_pages=32", "--cpu_threads=2"]) as server, \
            tempfile.TemporaryDirectory() as work:
        cli = [args.cli, f"--target={server.target}", "--timeout=20s"]

        def run(*words):
            r = subprocess.run(cli + list(words), capture_output=True, text=True, timeout=60)
            if r.returncode != 0:
                sys.exit(f"FAIL: {' '.join(words)}: {r.stderr}")
            return r.stdout

        run("create", "1")
        run("create", "2")
        run("append", "1", "--num_tokens=100")
        run("append", "2", "--num_tokens=10")
        decodes = 5
        for i in range(decodes):
            run("decode", "1,2", "--with_kv", f"--request_id={i}")
        batches = int(json.loads(run("stats"))["batches"])
        assert batches > 0, "the server reports no batches"

        port = free_port()
        config = os.path.join(work, "prometheus.yml")
        with open(config, "w", encoding="utf-8") as f:
            f.write("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                    "scrape_configs:\n  - job_name: pagedattn\n    static_configs:\n"
                    f"      - targets: ['127.0.0.1:{server.metrics_port}']\n")
        prom = subprocess.Popen(
            [args.prometheus, f"--config.file={config}", f"--storage.tsdb.path={work}/tsdb",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            got = t.poll(lambda: query(port, "pagedattn_batch_size_count"), timeout=25)
            if got is None:
                prom.kill()
                sys.exit("FAIL: Prometheus never answered pagedattn_batch_size_count:\n"
                         + prom.communicate()[1][-3000:])
            print(f"pagedattn_batch_size_count = {got} (server batches {batches})")
            assert got > 0, got
            # Every launch with attention is observed (appends-only launches may not be).
            assert decodes <= got <= batches, (got, decodes, batches)
            # Summed over the transport label (grpc, local), as the dashboard and rules do.
            ok = query(port, 'sum(pagedattn_requests_total{method="Decode",code="OK"})')
            assert ok == decodes, ok
            seqs = query(port, "pagedattn_batch_size_sum")
            assert seqs == 2 * decodes, seqs  # sequences decoded, over all batches
            pages = query(port, "pagedattn_kv_pages_free")
            assert pages == 32 - 2 - 1, pages
        finally:
            prom.terminate()
            prom.wait(timeout=10)
    print("PASS")


if __name__ == "__main__":
    main()
