"""pagedattn-cli against the real server: every subcommand, K/V from files, the output file,
JSON of config and stats, memory regions (register, list, unregister), and the exit status of a
failing call (1) and of bad usage (2); then a server of another model shape (fp16 tensors, fp8
pages), whose sizes and element type the CLI takes from its config.

usage: /usr/bin/python3 cli_test.py --server=BIN --cli=BIN
"""

import argparse
import json
import math
import os
import struct
import subprocess
import sys
import tempfile
from multiprocessing import shared_memory

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pagedattn_testing as t  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--server", required=True)
    p.add_argument("--cli", required=True)
    args = p.parse_args()
    with t.Server(args.server, ["--num_pages=16", "--num_layers=2", "--cpu_threads=2"]) as server, \
            tempfile.TemporaryDirectory() as work:
        base = [args.cli, f"--target={server.target}", "--timeout=20s"]

        def run(words, code=0):
            r = subprocess.run(base + words, capture_output=True, text=True, timeout=60)
            assert r.returncode == code, (words, r.returncode, r.stdout, r.stderr)
            return r.stdout, r.stderr

        config = json.loads(run(["config"])[0])
        assert config["num_layers"] == 2 and config["backend"] == "cpu", config
        assert int(config["num_pages"]) == 16, config

        run(["create", "5"])
        _, err = run(["create", "5"], code=1)
        assert "ALREADY_EXISTS" in err, err

        # Sizes from the server's shape (its defaults here): a token's K row, a sequence's q.
        row_elems = config["num_kv_heads"] * config["head_dim"]
        q_elems = config["num_qo_heads"] * config["head_dim"]
        rng = t.new_rng(3)
        kb, _ = t.random_bf16(10 * row_elems, rng)
        vb, _ = t.random_bf16(10 * row_elems, rng)
        kfile, vfile = os.path.join(work, "k.bin"), os.path.join(work, "v.bin")
        with open(kfile, "wb") as f:
            f.write(kb)
        with open(vfile, "wb") as f:
            f.write(vb)
        out, _ = run(["append", "5", f"--k_file={kfile}", f"--v_file={vfile}"])
        assert "appended 10 tokens to 2 layer(s), length 10" in out, out
        out, _ = run(["append", "5", "--num_tokens=60", "--layer=0"])
        out, _ = run(["append", "5", "--num_tokens=60", "--layer=1"])
        assert "length 70" in out, out

        outfile = os.path.join(work, "out.bin")
        out, _ = run(["decode", "5", "--with_kv", f"--output_file={outfile}"])
        assert out.count("sequence 5") == 2, out  # one line per layer
        data = open(outfile, "rb").read()
        assert len(data) == q_elems * 2, len(data)
        assert any(v != 0.0 for v in t.decode_bf16(data)), "all-zero output"

        # Export to a file, import as another sequence: the same decode, bit for bit.
        exported = os.path.join(work, "seq5.kv")
        out, _ = run(["export", "5", exported])
        assert "71 tokens exported" in out and "(2 chunks)" in out, out
        out, _ = run(["import", "7", exported])
        assert "71 tokens imported" in out, out
        _, err = run(["import", "7", exported], code=1)
        assert "ALREADY_EXISTS" in err, err
        qb, _ = t.random_bf16(q_elems, rng)
        qfile = os.path.join(work, "q.bin")
        with open(qfile, "wb") as f:
            f.write(qb)
        outs = []
        for sid in ("5", "7"):
            path = os.path.join(work, f"out{sid}.bin")
            run(["decode", sid, "--layer=1", f"--q_file={qfile}", f"--output_file={path}"])
            outs.append(open(path, "rb").read())
        assert outs[0] == outs[1] and len(outs[0]) == q_elems * 2, "import decodes differently"
        _, err = run(["offload", "7"], code=1)
        assert "FAILED_PRECONDITION" in err, err  # no host tier on this server
        with open(os.path.join(work, "junk.kv"), "wb") as f:
            f.write(b"\xff" * 7)
        run(["import", "8", os.path.join(work, "junk.kv")], code=1)
        run(["release", "7"])
        # migrate: straight from this server into another one, timed.
        with t.Server(args.server, ["--num_pages=16", "--num_layers=2", "--cpu_threads=2"]) as other:
            out, _ = run(["migrate", "5", other.target])
            assert "sequence 5: 71 tokens" in out and "migrated in" in out, out
            theirs = json.loads(subprocess.run([args.cli, f"--target={other.target}", "stats"],
                                               capture_output=True, text=True, timeout=60).stdout)
            assert int(theirs["sequences"]) == 1 and int(theirs["tokens"]) == 71, theirs
            _, err = run(["migrate", "5", other.target], code=1)
            assert "ALREADY_EXISTS" in err, err
            _, err = run(["migrate", "99", other.target], code=1)
            assert "NOT_FOUND" in err, err
            theirs = json.loads(subprocess.run([args.cli, f"--target={other.target}", "stats"],
                                               capture_output=True, text=True, timeout=60).stdout)
            assert int(theirs["sequences"]) == 1 and int(theirs["pages_free"]) == 16 - 2, theirs
            # migrate --via_region: the same through one shared-memory object registered on
            # both servers (gone from both afterwards, also after a refusal).
            def other_cli(*words):
                return subprocess.run([args.cli, f"--target={other.target}", *words],
                                      capture_output=True, text=True, timeout=60)
            assert other_cli("release", "5").returncode == 0
            out, _ = run(["migrate", "5", other.target, "--via_region"])
            assert "sequence 5: 71 tokens" in out and "through a registered region" in out, out
            _, err = run(["migrate", "5", other.target, "--via_region"], code=1)
            assert "ALREADY_EXISTS" in err, err
            assert other_cli("release", "5").returncode == 0
            out, _ = run(["migrate", "5", other.target, "--via_region", "--repeat=2"])
            assert out.count("sequence 5: 71 tokens") == 2 and "median of 2" in out, out
            for listed in (run(["memory"])[0], other_cli("memory").stdout):
                assert "pa-migrate" not in listed, listed
            theirs = json.loads(other_cli("stats").stdout)
            assert int(theirs["sequences"]) == 1 and int(theirs["tokens"]) == 71, theirs

        run(["fork", "5", "6"])
        run(["decode", "5,6", "--layer=1"])
        _, err = run(["decode", "5,5"], code=1)
        assert "INVALID_ARGUMENT" in err, err
        stats = json.loads(run(["stats"])[0])
        assert int(stats["sequences"]) == 2 and int(stats["tokens"]) == 142, stats
        assert int(stats["pages_free"]) == 16 - 2, stats

        run(["release", "6"])
        _, err = run(["release", "6"], code=1)
        assert "NOT_FOUND" in err, err
        run(["release", "5"])
        stats = json.loads(run(["stats"])[0])
        assert int(stats["pages_free"]) == 16 and int(stats["sequences"]) == 0, stats

        # Memory regions: a shared-memory object of this process's, registered, listed and
        # unregistered through the CLI.
        shm = shared_memory.SharedMemory(create=True, size=1 << 16)
        try:
            key = "/" + shm.name
            out, _ = run(["register", "cli-region", key, "4096", "--offset=64"])
            assert "cli-region: registered" in out, out
            _, err = run(["register", "cli-region", key, "4096"], code=1)
            assert "ALREADY_EXISTS" in err, err
            _, err = run(["register", "other", "/pa-cli-no-such-object", "4096"], code=1)
            assert "FAILED_PRECONDITION" in err, err
            listed = json.loads(run(["memory"])[0])
            assert listed["regions"] == [{"name": "cli-region", "kind": "system",
                                          "byte_size": "4096", "device_id": -1}], listed
            out, _ = run(["unregister", "cli-region"])
            assert "cli-region: unregistered" in out, out
            _, err = run(["unregister", "cli-region"], code=1)
            assert "NOT_FOUND" in err, err
            assert json.loads(run(["memory"])[0]).get("regions", []) == [], "regions left listed"
            run(["register", "x", key], code=2)
        finally:
            shm.close()
            shm.unlink()

        run(["bogus"], code=2)
        run(["fork", "1"], code=2)

    # Another model shape in fp16: every size and the element type come from the config.
    shape = ["--num_qo_heads=8", "--num_kv_heads=2", "--head_dim=64", "--page_size=16",
             "--dtype=fp16", "--kv_cache_dtype=fp8_e4m3"]
    with t.Server(args.server, ["--num_pages=16", "--num_layers=2", "--cpu_threads=2", *shape]) \
            as server, tempfile.TemporaryDirectory() as work:
        base = [args.cli, f"--target={server.target}", "--timeout=20s"]

        def run_other(words):
            r = subprocess.run(base + words, capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, (words, r.returncode, r.stdout, r.stderr)
            return r.stdout

        config = json.loads(run_other(["config"]))
        assert (config["num_qo_heads"], config["head_dim"], config["page_size"]) == (8, 64, 16)
        assert (config["dtype"], config["kv_cache_dtype"]) == ("fp16", "fp8_e4m3"), config
        run_other(["create", "1"])
        assert "length 20" in run_other(["append", "1", "--num_tokens=20"])
        outfile = os.path.join(work, "out.bin")
        run_other(["decode", "1", "--with_kv", f"--output_file={outfile}"])
        data = open(outfile, "rb").read()
        assert len(data) == 8 * 64 * 2, len(data)
        values = struct.unpack(f"<{8 * 64}e", data)
        assert all(math.isfinite(v) for v in values) and any(v != 0.0 for v in values), values[:8]
    print("PASS")


if __name__ == "__main__":
    main()
