#!/usr/bin/python3
"""The container image, built and run on a real Docker engine (ctest label: container).

  --check=image    deploy/build-image.sh cpu and prometheus: pagedattn:cpu and
                   pagedattn-prometheus:local exist afterwards; prints their sizes and times.
  --check=run      pagedattn:cpu with a read-only root file system, ports on 127.0.0.1: Docker's
                   HEALTHCHECK turns healthy and pagedattn-health answers SERVING from the host;
                   pagedattn-cli and the Python client package create, append and decode,
                   outputs checked against a Python reference; pagedattn-loadgen checks its decodes against its CPU reference;
                   the server's uid is not 0; `docker stop` during an in-flight decode drains
                   it (the decode succeeds) and the container exits 0 within its grace period.
  --check=compose  deploy/docker-compose.yml (plus tests/container/compose.test.yml: a small
                   pool, free host ports) up: Prometheus's target for the server is up, every
                   dashboard query returns data, every alert rule evaluates cleanly and every
                   metric the rules use has data; down leaves no container, network or volume.

Needs a running Docker engine: without one (or without root where the base image must still be
made) it exits 77, which ctest reports as skipped, with the reason on stdout (`ctest -V`);
with PAGEDATTN_CONTAINER_REQUIRED=1 it fails instead. .ci/run's last stage starts an engine,
runs these with that variable set and stops the engine.
Run by ctest (tests/container/CMakeLists.txt) with Debian's /usr/bin/python3 (python3-yaml).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(SOURCE, "tests", "integration"))
sys.path.insert(0, os.path.join(SOURCE, "tests", "deploy"))
import pagedattn_testing as t  # noqa: E402
import live_stack_test as live  # noqa: E402

IMAGE = "pagedattn:cpu"
PROMETHEUS_IMAGE = "pagedattn-prometheus:local"
BASE = os.environ.get("PAGEDATTN_CPU_BASE", "pagedattn-base:bookworm")
HEALTH_SERVICE = "pagedattn.v1.PagedAttention"
SKIP = 77


def fail(message):
    print(f"FAIL: {message}", file=sys.stderr)
    sys.exit(1)


def skip(message):
    # .ci/run's container stage starts the engine itself: there a skip would hide a failure.
    if os.environ.get("PAGEDATTN_CONTAINER_REQUIRED") == "1":
        fail(f"cannot run, and PAGEDATTN_CONTAINER_REQUIRED=1: {message}")
    print(f"SKIP: {message}")
    sys.exit(SKIP)


def docker_client():
    """The first docker client whose API the running engine accepts, or None."""
    candidates = [os.environ.get("DOCKER"), "/usr/bin/docker", shutil.which("docker")]
    for c in candidates:
        if c and os.access(c, os.X_OK):
            r = subprocess.run([c, "version", "--format", "{{.Server.APIVersion}}"],
                               capture_output=True, text=True, timeout=30)
            if r.returncode == 0:
                return c
    return None


class Docker:
    def __init__(self):
        self.bin = docker_client()
        if self.bin is None:
            skip("no Docker engine answers (start one as root: deploy/build-image.sh engine; "
                 ".ci/run's container stage does)")

    def __call__(self, *args, check=True, timeout=120, **kw):
        r = subprocess.run([self.bin, *args], capture_output=True, text=True, timeout=timeout,
                           **kw)
        if check and r.returncode != 0:
            fail(f"docker {' '.join(args)}: exit {r.returncode}\n{r.stdout}{r.stderr}")
        return r

    def has_image(self, name):
        return self("image", "inspect", name, check=False).returncode == 0

    def size_mb(self, name):
        return int(self("image", "inspect", "-f", "{{.Size}}", name).stdout) / 1e6

    def port(self, name, port):
        """The host address a container port is published on (127.0.0.1:NNNNN)."""
        out = self("port", name, f"{port}/tcp").stdout.split()
        if not out or not out[0].startswith("127.0.0.1:"):
            fail(f"port {port} of {name} is not published on 127.0.0.1: {out}")
        return out[0]

    def remove(self, name):
        self("rm", "-f", "-v", name, check=False)


def run(cmd, expect_rc=0, what="", timeout=120):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != expect_rc:
        fail(f"{what or cmd[0]}: exit {r.returncode}, expected {expect_rc}: {' '.join(cmd)}\n"
             f"{r.stdout}{r.stderr}")
    return r


# ---- --check=image ----------------------------------------------------------------------------

def check_image(args):
    docker = Docker()
    if not docker.has_image(BASE) and os.geteuid() != 0:
        skip(f"the base image {BASE} is absent and making it (debootstrap) needs root")
    env = dict(os.environ, DOCKER=docker.bin)
    for what, image in (("cpu", IMAGE), ("prometheus", PROMETHEUS_IMAGE)):
        started = time.monotonic()
        r = subprocess.run([os.path.join(SOURCE, "deploy", "build-image.sh"), what], env=env,
                           capture_output=True, text=True, timeout=1500)
        took = time.monotonic() - started
        if r.returncode != 0:
            fail(f"deploy/build-image.sh {what}: exit {r.returncode}\n"
                 f"{r.stdout[-6000:]}{r.stderr[-6000:]}")
        if not docker.has_image(image):
            fail(f"deploy/build-image.sh {what} exited 0 but {image} does not exist")
        print(f"{image}: built in {took:.0f} s (cached layers count), "
              f"{docker.size_mb(image):.0f} MB")
    print(f"{BASE}: {docker.size_mb(BASE):.0f} MB")
    config = json.loads(docker("image", "inspect", "-f", "{{json .Config}}", IMAGE).stdout)
    if config.get("User") in (None, "", "0", "root") or config["User"].startswith(("0:", "root:")):
        fail(f"{IMAGE} runs as root: User={config.get('User')!r}")
    if "pagedattn-health" not in " ".join(config.get("Healthcheck", {}).get("Test", [])):
        fail(f"{IMAGE} has no pagedattn-health HEALTHCHECK: {config.get('Healthcheck')}")
    print("PASS")


# ---- --check=run ------------------------------------------------------------------------------

def start_container(docker, name, flags):
    docker.remove(name)
    docker("run", "-d", "--name", name, "--read-only", "--stop-timeout", "30",
           "-p", "127.0.0.1::50051", "-p", "127.0.0.1::9464", IMAGE,
           "--backend=cpu", "--cpu_threads=2", *flags)
    return docker.port(name, 50051), docker.port(name, 9464)


def wait_healthy(docker, name, timeout=90):
    """Docker's own HEALTHCHECK (pagedattn-health inside the container) says healthy."""
    deadline = time.monotonic() + timeout
    while True:
        state = json.loads(docker("inspect", "-f", "{{json .State}}", name).stdout)
        health = (state.get("Health") or {}).get("Status")
        if health == "healthy":
            return
        if not state.get("Running") or health == "unhealthy" or time.monotonic() > deadline:
            logs = docker("logs", name, check=False)
            fail(f"{name} not healthy (running={state.get('Running')}, health={health}, "
                 f"log={json.dumps((state.get('Health') or {}).get('Log', [])[-2:])})\n"
                 f"{logs.stdout}{logs.stderr}")
        time.sleep(1)


def write_bf16(path, count, rng):
    data, values = t.random_bf16(count, rng)
    with open(path, "wb") as f:
        f.write(data)
    return values


def check_decode_against_reference(cli, target, work):
    """create, append K/V from files, decode a batch of two with queries from a file: the output
    matches the Python reference of the decode attention."""
    c = [cli, f"--target={target}", "--timeout=30s"]
    rng = t.new_rng(11)
    lengths = {701: 37, 702: 90}  # 90 tokens: several pages
    keys, values = {}, {}
    for sid, n in lengths.items():
        run(c + ["create", str(sid)], what="create")
        kf, vf = os.path.join(work, f"k{sid}"), os.path.join(work, f"v{sid}")
        kflat, vflat = write_bf16(kf, n * 512, rng), write_bf16(vf, n * 512, rng)
        out = run(c + ["append", str(sid), f"--k_file={kf}", f"--v_file={vf}"],
                  what="append").stdout
        if f"length {n}" not in out:
            fail(f"append to {sid}: {out}")
        keys[sid] = [kflat[i * 512:(i + 1) * 512] for i in range(n)]
        values[sid] = [vflat[i * 512:(i + 1) * 512] for i in range(n)]
    qf, of = os.path.join(work, "q"), os.path.join(work, "out")
    q = write_bf16(qf, 2 * 24 * 128, rng)
    run(c + ["decode", "701,702", "--layer=1", f"--q_file={qf}", f"--output_file={of}"],
        what="decode")
    got = t.decode_bf16(open(of, "rb").read())
    if len(got) != 2 * 24 * 128:
        fail(f"decode output has {len(got)} values, expected {2 * 24 * 128}")
    scale = 1.0 / (128 ** 0.5)
    for i, sid in enumerate(lengths):
        want, _ = t.reference(q[i * 3072:(i + 1) * 3072], keys[sid], values[sid], scale)
        err = t.rel_l2(got[i * 3072:(i + 1) * 3072], want)
        # bf16 output: a relative error of about 2^-9 per value.
        if not err < 1e-2:
            fail(f"decode of sequence {sid}: relative L2 error {err:.3g} against the reference")
        print(f"decode of sequence {sid} ({lengths[sid]} tokens): rel L2 {err:.2e} vs reference")
    for sid in lengths:
        run(c + ["release", str(sid)], what="release")


def check_python_client(target, package):
    """The Python client package (`package`: the build tree's python folder) creates, appends
    over every layer and decodes against the container; the result is checked against the
    float64 reference of tests/python/package_testing."""
    sys.path.insert(0, package)
    sys.path.insert(0, os.path.join(SOURCE, "tests", "python"))
    import numpy as np  # pylint: disable=import-outside-toplevel
    import pagedattn  # pylint: disable=import-outside-toplevel
    import package_testing as pt  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(23)
    sid = 4242
    with pagedattn.Client(target) as client:
        client.wait_for_connected(10)
        cfg = client.config
        client.create(sid)
        try:
            keys = values = None
            for layer in range(cfg.num_layers):
                keys = pt.random_bf16(rng, cfg.kv_shape(70))
                values = pt.random_bf16(rng, cfg.kv_shape(70))
                client.append(sid, layer, keys, values)
            q = pt.random_bf16(rng, cfg.q_shape(1))
            result = client.decode(cfg.num_layers - 1, [sid], q)
            want_out, want_lse = pt.reference(q[0], keys, values, 1.0 / np.sqrt(cfg.head_dim))
            err = np.linalg.norm(result.output[0] - want_out) / np.linalg.norm(want_out)
            lse_err = float(np.max(np.abs(result.lse[0] - want_lse)))
            if not (err < 1e-2 and lse_err < 1e-3):
                fail(f"python client: output rel L2 {err:.3g}, lse error {lse_err:.3g}")
        finally:
            client.release(sid)
    print(f"python client: create, append over {cfg.num_layers} layers and decode match the "
          f"reference (output rel L2 {err:.2g}, lse error {lse_err:.2g})")


def check_run(args):
    docker = Docker()
    if not docker.has_image(IMAGE):
        fail(f"{IMAGE} does not exist: run the container.image test (deploy/build-image.sh cpu)")
    name = f"pagedattn-ctest-run-{os.getpid()}"
    drain_name = f"pagedattn-ctest-drain-{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="pagedattn-container-") as work:
        try:
            grpc, metrics = start_container(
                docker, name, ["--num_pages=256", "--num_layers=2", "--drain_timeout=20s"])
            print(f"{name}: grpc {grpc}, metrics {metrics}")
            wait_healthy(docker, name)
            r = run([args.health, f"--address={grpc}", f"--service={HEALTH_SERVICE}",
                     "--timeout=2s"], what="pagedattn-health from the host")
            if "SERVING" not in r.stdout:
                fail(f"pagedattn-health: {r.stdout}")
            print(f"health: Docker says healthy; from the host: {r.stdout.strip()}")

            uid = docker("exec", name, "id", "-u").stdout.strip()
            if uid in ("", "0"):
                fail(f"the server runs as uid {uid!r}")
            if docker("inspect", "-f", "{{.HostConfig.ReadonlyRootfs}}", name).stdout.strip() \
                    != "true":
                fail("the container's root file system is not read-only")
            w = docker("exec", name, "touch", "/usr/local/bin/x", check=False)
            if w.returncode == 0:
                fail("a write to the root file system succeeded")
            print(f"uid {uid}; root file system read-only ({w.stderr.strip()})")

            cli = [args.cli, f"--target={grpc}", "--timeout=30s"]
            config = json.loads(run(cli + ["config"], what="config").stdout)
            if config.get("backend") != "cpu" or config.get("num_layers") != 2:
                fail(f"config: {config}")
            check_decode_against_reference(args.cli, grpc, work)
            check_python_client(grpc, args.python_package)

            out = os.path.join(work, "loadgen.json")
            run([args.loadgen, f"--target={grpc}", f"--metrics_address={metrics}",
                 "--wait_for_server=10s", "--batch_size=4", "--concurrency=2",
                 "--context_len=200", "--steps=6", "--check_sequences=3", f"--out={out}"],
                what="pagedattn-loadgen", timeout=300)
            run([sys.executable, os.path.join(SOURCE, "tests", "loadgen", "check_result.py"),
                 out], what="check_result.py")
            print("pagedattn-loadgen: decodes match its CPU reference (check_result.py)")
            stats = json.loads(run(cli + ["stats"], what="stats").stdout)
            if int(stats.get("sequences", 0)) != 0:
                fail(f"sequences left after the clients released them: {stats}")
        finally:
            docker.remove(name)

        try:
            check_drain(docker, args, drain_name, work)
        finally:
            docker.remove(drain_name)
    print("PASS")


def check_drain(docker, args, name, work):
    """docker stop while a decode waits in the batcher: the decode succeeds, the container exits
    0 well inside its 30 s stop timeout. A 4 s batching window holds the decode in the queue."""
    grpc, _ = start_container(docker, name, ["--num_pages=64", "--num_layers=1",
                                             "--drain_timeout=20s",
                                             "--max_queue_delay_us=4000000"])
    wait_healthy(docker, name)
    cli = [args.cli, f"--target={grpc}", "--timeout=30s"]
    run(cli + ["create", "5"], what="create")
    run(cli + ["append", "5", "--num_tokens=40"], what="append")
    started = time.monotonic()
    decode = subprocess.Popen(cli + ["decode", "5", f"--output_file={work}/drain.out"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)
    if decode.poll() is not None:
        out, err = decode.communicate()
        fail(f"the decode finished before docker stop (rc {decode.returncode}): it was meant to "
             f"wait for its batch\n{out}{err}")
    stop_started = time.monotonic()
    docker("stop", name, timeout=60)
    stop_took = time.monotonic() - stop_started
    out, err = decode.communicate(timeout=60)
    if decode.returncode != 0:
        fail(f"the in-flight decode failed across docker stop (rc {decode.returncode})\n"
             f"{out}{err}")
    if os.path.getsize(f"{work}/drain.out") != 24 * 128 * 2:
        fail("the in-flight decode wrote no output")
    state = json.loads(docker("inspect", "-f", "{{json .State}}", name).stdout)
    logs = docker("logs", name, check=False)
    if state["ExitCode"] != 0 or state.get("OOMKilled"):
        fail(f"container exit code {state['ExitCode']} after docker stop (137: killed at the "
             f"end of the grace period)\n{logs.stdout}{logs.stderr}")
    if stop_took >= 30:
        fail(f"docker stop took {stop_took:.1f} s, the whole grace period")
    print(f"drain: decode in flight for {stop_started - started:.1f} s when docker stop began; "
          f"it succeeded; the container exited 0 after {stop_took:.1f} s")


# ---- --check=compose --------------------------------------------------------------------------

def check_compose(args):
    docker = Docker()
    for image in (IMAGE, PROMETHEUS_IMAGE):
        if not docker.has_image(image):
            fail(f"{image} does not exist: run the container.image test first")
    project = f"pagedattnctest{os.getpid()}"
    ports = {name: live.free_port() for name in
             ("PAGEDATTN_GRPC_PORT", "PAGEDATTN_METRICS_PORT", "PROMETHEUS_PORT")}
    env = dict(os.environ, PAGEDATTN_IMAGE=IMAGE, PROMETHEUS_IMAGE=PROMETHEUS_IMAGE,
               PROMETHEUS_BASE=BASE, **{k: str(v) for k, v in ports.items()})
    env["DOCKER_HOST"] = env.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    compose = [args.compose, "-p", project, "-f", os.path.join(SOURCE, "deploy",
               "docker-compose.yml"), "-f", os.path.join(HERE, "compose.test.yml")]

    def compose_run(*words, check=True, timeout=300):
        r = subprocess.run(compose + list(words), capture_output=True, text=True, env=env,
                           timeout=timeout)
        if check and r.returncode != 0:
            fail(f"docker-compose {' '.join(words)}: exit {r.returncode}\n{r.stdout}{r.stderr}")
        return r

    try:
        compose_run("up", "-d")
        ps = compose_run("ps").stdout
        print(ps)
        server_container = f"{project}_pagedattn_1"
        wait_healthy(docker, server_container)
        grpc = f"127.0.0.1:{ports['PAGEDATTN_GRPC_PORT']}"
        base = f"http://127.0.0.1:{ports['PROMETHEUS_PORT']}"
        server = argparse.Namespace(grpc=grpc)
        live.scenario(args.cli, server, 1000)

        deadline = time.monotonic() + 90
        while True:
            try:
                status, result = live.prometheus_query(base, 'up{job="pagedattn"}')
            except OSError as e:
                status, result = "error", str(e)
            if status == "ok" and result and result[0]["value"][1] == "1":
                break
            if time.monotonic() > deadline:
                logs = compose_run("logs", "--tail=40", check=False)
                fail(f"Prometheus's pagedattn target never up: {status} {result}\n"
                     f"{logs.stdout}{logs.stderr}")
            time.sleep(1)
        targets = json.loads(live.http_get(f"{base}/api/v1/targets"))["data"]["activeTargets"]
        print("targets: " + ", ".join(f"{x['labels']['job']}={x['health']} ({x['scrapeUrl']})"
                                      for x in targets))
        # Counters must move between scrapes for rate() to have data.
        time.sleep(6)
        live.scenario(args.cli, server, 2000)

        queries = live.dashboard_queries(args.dashboard)
        rule_queries = []
        for rules in args.rules:
            for alert, expr in live.rule_exprs(rules):
                for name in sorted(set(live.METRIC_RE.findall(expr))):
                    rule_queries.append((f"rule {alert}", name))
                if "up{" in expr:
                    rule_queries.append((f"rule {alert}", 'up{job="pagedattn"}'))
        if len(queries) < 10 or len(rule_queries) < 5:
            fail(f"too few queries parsed: {len(queries)} dashboard, {len(rule_queries)} rules")
        deadline = time.monotonic() + 60
        while True:
            empty, errors = [], []
            for title, expr in queries + [(w, q) for w, q in rule_queries]:
                promql = live.grafana_to_promql(expr)
                status, result = live.prometheus_query(base, promql)
                if status != "ok":
                    errors.append(f"{title}: {result}\n    {promql}")
                elif not result:
                    empty.append(f"{title}: {promql}")
            if errors:
                fail("queries Prometheus rejects:\n  " + "\n  ".join(errors))
            if not empty:
                break
            if time.monotonic() > deadline:
                fail("queries with no data after real traffic:\n  " + "\n  ".join(empty))
            time.sleep(2)
        print(f"all {len(queries)} dashboard queries and the {len(rule_queries)} metric "
              f"selectors of the alert rules return data")

        deadline = time.monotonic() + 30
        while True:
            groups = json.loads(live.http_get(f"{base}/api/v1/rules"))["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            bad = [f"{r['name']}: {r.get('lastError')}" for r in rules if r["health"] == "err"]
            if bad:
                fail("rules that fail to evaluate:\n  " + "\n  ".join(bad))
            if len(rules) >= 5 and all(r["health"] == "ok" for r in rules):
                break
            if time.monotonic() > deadline:
                fail(f"rules not loaded and evaluated: {[(r['name'], r['health']) for r in rules]}")
            time.sleep(1)
        print(f"all {len(rules)} alert rules loaded in the compose Prometheus, evaluating cleanly")
    finally:
        down = compose_run("down", "-v", "--remove-orphans", "-t", "30", check=False)
    if down.returncode != 0:
        fail(f"docker-compose down: exit {down.returncode}\n{down.stdout}{down.stderr}")
    label = f"label=com.docker.compose.project={project}"
    left = {
        "containers": docker("ps", "-a", "-q", "--filter", label).stdout.split(),
        "networks": docker("network", "ls", "-q", "--filter", label).stdout.split(),
        "volumes": docker("volume", "ls", "-q", "--filter", label).stdout.split(),
    }
    if any(left.values()):
        fail(f"docker-compose down left {left}")
    print("compose down: no container, network or volume of the project left")
    print("PASS")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", choices=["image", "run", "compose"], required=True)
    p.add_argument("--cli")
    p.add_argument("--loadgen")
    p.add_argument("--health")
    p.add_argument("--python_package", help="the build tree's python folder (pagedattn package)")
    p.add_argument("--compose", default="docker-compose")
    p.add_argument("--dashboard", default=os.path.join(SOURCE, "deploy", "grafana", "dashboards",
                                                       "pagedattn.json"))
    p.add_argument("--rules", action="append")
    args = p.parse_args()
    if not args.rules:
        args.rules = [os.path.join(SOURCE, "deploy", "prometheus", "rules", "pagedattn.rules.yml")]
    {"image": check_image, "run": check_run, "compose": check_compose}[args.check](args)


if __name__ == "__main__":
    main()
