"""Helpers for the Python integration tests: start the real pagedattn-server on free loopback
ports, bf16 conversion, and a pure-Python reference of the decode attention (no numpy)."""

import math
import random
import re
import struct
import subprocess
import threading
import time

NUM_QO_HEADS = 24
NUM_KV_HEADS = 4
HEAD_DIM = 128
GROUP = NUM_QO_HEADS // NUM_KV_HEADS

_SERVING = re.compile(r"serving grpc=[^:\s]+:(\d+) metrics=(?:[^:\s]+:(\d+)|off)")

# What opens a sanitizer report in a process's output. A sanitizer build's server prints its
# reports and runs on (halt_on_error=0), so its exit status alone does not show them.
_SANITIZER = re.compile(r"^.*(WARNING: ThreadSanitizer|ERROR: (Thread|Address|Leak)Sanitizer"
                        r"|: runtime error: ).*$", re.MULTILINE)


def check_no_sanitizer_report(output):
    """Raises AssertionError with the first sanitizer report (at most 16 KiB) in `output`."""
    m = _SANITIZER.search(output)
    if m:
        raise AssertionError("the server printed a sanitizer report:\n" + output[m.start():][:16384])


class Server:
    """A pagedattn-server process; use as a context manager (killed on exit if still running)."""

    def __init__(self, binary, flags=(), timeout=30.0):
        self.proc = subprocess.Popen(
            [binary, "--grpc_address=127.0.0.1:0", "--metrics_address=127.0.0.1:0", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.output = []
        self._ready = threading.Event()
        self.grpc_port = self.metrics_port = None
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(timeout) or self.grpc_port is None:
            self.kill()
            raise RuntimeError("server did not start:\n" + "".join(self.output))
        self.target = f"127.0.0.1:{self.grpc_port}"

    def _read(self):
        for line in self.proc.stdout:
            self.output.append(line)
            m = _SERVING.search(line)
            if m and not self._ready.is_set():
                self.grpc_port = int(m.group(1))
                self.metrics_port = int(m.group(2)) if m.group(2) else None
                self._ready.set()
        self._ready.set()

    def kill(self):
        """Kills the server if it still runs; AssertionError if it printed a sanitizer report."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        check_no_sanitizer_report("".join(self.output))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()


def bf16_bits(x):
    """float -> bf16 bit pattern, round to nearest even."""
    (u,) = struct.unpack("<I", struct.pack("<f", x))
    if (u & 0x7F800000) == 0x7F800000 and (u & 0x7FFFFF):
        return (u >> 16) | 0x40
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def bf16_value(bits):
    (f,) = struct.unpack("<f", struct.pack("<I", bits << 16))
    return f


def random_bf16(count, rng):
    """count random normal values: (bf16 bytes, the bf16-rounded floats)."""
    bits = [bf16_bits(rng.gauss(0.0, 1.0)) for _ in range(count)]
    return struct.pack(f"<{count}H", *bits), [bf16_value(b) for b in bits]


def decode_bf16(data):
    return [bf16_value(b) for b in struct.unpack(f"<{len(data) // 2}H", data)]


def decode_f32(data):
    return list(struct.unpack(f"<{len(data) // 4}f", data))


def reference(q, keys, values, sm_scale):
    """One sequence: q [24*128] floats, keys/values lists of tokens, each [4*128] floats.
    Returns (output [24*128], lse [24], base 2) in float64."""
    out, lse = [], []
    for h in range(NUM_QO_HEADS):
        kv = h // GROUP
        qh = q[h * HEAD_DIM:(h + 1) * HEAD_DIM]
        scores = []
        for k in keys:
            kh = k[kv * HEAD_DIM:(kv + 1) * HEAD_DIM]
            scores.append(sm_scale * sum(a * b for a, b in zip(qh, kh)))
        if not scores:
            out.extend([0.0] * HEAD_DIM)
            lse.append(-math.inf)
            continue
        m = max(scores)
        weights = [math.exp(s - m) for s in scores]
        total = sum(weights)
        acc = [0.0] * HEAD_DIM
        for w, v in zip(weights, values):
            vh = v[kv * HEAD_DIM:(kv + 1) * HEAD_DIM]
            for d in range(HEAD_DIM):
                acc[d] += w * vh[d]
        out.extend(a / total for a in acc)
        lse.append((m + math.log(total)) / math.log(2.0))
    return out, lse


def rel_l2(got, want):
    err = math.sqrt(sum((a - b) ** 2 for a, b in zip(got, want)))
    norm = math.sqrt(sum(b * b for b in want))
    return err / norm if norm > 0 else err


def poll(predicate, timeout, interval=0.2):
    """Calls predicate until it returns a truthy value or timeout passes; returns the last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def new_rng(seed):
    return random.Random(seed)
