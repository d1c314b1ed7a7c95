#!/usr/bin/python3
"""Drives a pagedattn server with pagedattn-cli for a few minutes, in phases, so that every
dashboard panel has something to show: decode steps in batches, prefills, forks, caller errors
(NOT_FOUND, ALREADY_EXISTS), a KV pool driven nearly full (RESOURCE_EXHAUSTED, the
pool_exhausted rejection), then releases. Bounded in time; loopback targets only.

  deploy/demo-load.py --cli=build/bin/pagedattn-cli --target=127.0.0.1:50051 --minutes=8
"""
import argparse
import random
import subprocess
import threading
import time

# (share of the run, workers, prompt tokens range): warm-up, long prompts that fill the pool,
# a wider but shorter load, a cool-down.
PHASES = [(0.2, 2, (64, 400)), (0.35, 5, (600, 1600)), (0.25, 4, (64, 500)), (0.2, 1, (64, 200))]


class Load:
    def __init__(self, args):
        self.args = args
        self.stop_at = time.monotonic() + args.minutes * 60
        self.workers_wanted = 0
        self.lock = threading.Lock()
        self.calls = 0

    def cli(self, *words):
        with self.lock:
            self.calls += 1
        r = subprocess.run([self.args.cli, f"--target={self.args.target}", "--timeout=30s",
                            *map(str, words)], capture_output=True, text=True)
        return r.returncode == 0

    def worker(self, index, prompts):
        rng = random.Random(index)
        next_id = (index + 1) * 1_000_000
        while time.monotonic() < self.stop_at and index < self.workers_wanted:
            n = rng.randint(2, 6)
            ids = list(range(next_id, next_id + n))
            next_id += n + 1
            live = [i for i in ids if self.cli("create", i)]
            for i in list(live):
                if not self.cli("append", i, f"--num_tokens={rng.randint(*prompts[0])}"):
                    live.remove(i)  # pool exhausted: this one stays empty
            if rng.random() < 0.3 and live:
                child = next_id
                next_id += 1
                if self.cli("fork", live[0], child):
                    live.append(child)
            for _ in range(rng.randint(10, 40)):
                if time.monotonic() >= self.stop_at or not live:
                    break
                self.cli("decode", ",".join(map(str, live)), "--with_kv")
                roll = rng.random()
                if roll < 0.03:
                    self.cli("decode", next_id + 500_000)  # NOT_FOUND
                elif roll < 0.05:
                    self.cli("create", live[0])  # ALREADY_EXISTS
                elif roll < 0.10:
                    self.cli("stats")
            for i in ids + [i for i in live if i not in ids]:
                self.cli("release", i)
            time.sleep(rng.uniform(0.0, 0.5))

    def run(self):
        start = time.monotonic()
        threads = []
        prompts = [PHASES[0][2]]
        for share, workers, prompt in PHASES:
            phase_end = min(self.stop_at, time.monotonic() + share * self.args.minutes * 60)
            prompts[0] = prompt
            self.workers_wanted = workers
            for i in range(len([t for t in threads if t.is_alive()]), workers):
                t = threading.Thread(target=self.worker, args=(i, prompts), daemon=True)
                t.start()
                threads.append(t)
            print(f"{time.monotonic() - start:6.0f}s: {workers} workers, prompts {prompt}",
                  flush=True)
            while time.monotonic() < phase_end:
                time.sleep(1)
        self.stop_at = time.monotonic()
        for t in threads:
            t.join(timeout=60)
        print(f"done: {self.calls} CLI calls in {time.monotonic() - start:.0f}s")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cli", required=True)
    p.add_argument("--target", default="127.0.0.1:50051")
    p.add_argument("--minutes", type=float, default=8)
    args = p.parse_args()
    host = args.target.rsplit(":", 1)[0]
    if host not in ("127.0.0.1", "localhost", "[::1]"):
        raise SystemExit("demo-load.py only drives a server on this machine's loopback")
    Load(args).run()


if __name__ == "__main__":
    main()
