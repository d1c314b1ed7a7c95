"""`pip install client/python` the offline way the package's README gives (a venv reusing the
system's grpcio/protobuf/numpy, --no-build-isolation --no-index), from a copy of the package
and the proto in a temp dir, then the README's example run by the venv's python against the
real pagedattn-server, with the server's stats checked afterwards.

usage: /usr/bin/python3 install_test.py --server=BIN --source=REPOSITORY_ROOT
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

import package_testing as t


def readme_example(source):
    with open(os.path.join(source, "client", "python", "README.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    [example] = [b for b in blocks if "asyncio.run(main())" in b]
    return example


class InstallTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="pagedattn-pip-")
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)

    def run_checked(self, args, **kwargs):
        p = subprocess.run(args, capture_output=True, text=True, timeout=120, **kwargs)
        self.assertEqual(p.returncode, 0, f"{args}\n{p.stdout}\n{p.stderr}")
        return p.stdout

    def test_pip_install_then_the_readme_example(self):
        src = os.path.join(self.dir, "src")
        shutil.copytree(os.path.join(t.ARGS.source, "client", "python"),
                        os.path.join(src, "client", "python"),
                        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        shutil.copytree(os.path.join(t.ARGS.source, "proto"), os.path.join(src, "proto"))
        venv = os.path.join(self.dir, "venv")
        self.run_checked([sys.executable, "-m", "venv", "--system-site-packages", venv])
        python = os.path.join(venv, "bin", "python")
        env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
        env.pop("PYTHONPATH", None)
        self.run_checked([os.path.join(venv, "bin", "pip"), "install", "--no-build-isolation",
                          "--no-index", os.path.join(src, "client", "python")], env=env)
        where = self.run_checked([python, "-c", "import pagedattn; print(pagedattn.__file__)"],
                                 cwd=self.dir, env=env).strip()
        self.assertTrue(where.startswith(venv), where)

        with t.Server(t.ARGS.server, ["--num_pages=64", "--num_layers=3", "--cpu_threads=2"]) as s:
            example = readme_example(t.ARGS.source).replace("127.0.0.1:50051", s.target)
            self.assertIn(s.target, example)
            script = os.path.join(self.dir, "example.py")
            with open(script, "w") as f:
                f.write(example)
            self.run_checked([python, script], cwd=self.dir, env=env)
            stats = json.loads(self.run_checked([python, "-c", (
                "import dataclasses, json, sys, pagedattn\n"
                f"c = pagedattn.Client({s.target!r})\n"
                "print(json.dumps({**dataclasses.asdict(c.stats()), "
                "'layers': c.config.num_layers}))\n")], cwd=self.dir, env=env))
        # Two micro-batches of two sequences, 8 steps over every layer, all released.
        self.assertEqual(stats["layers"], 3)
        self.assertEqual(stats["decoded_sequences"], 2 * 2 * 8 * 3)
        self.assertEqual((stats["sequences"], stats["tokens"]), (0, 0))
        self.assertEqual(stats["pages_free"], stats["pages_total"])


if __name__ == "__main__":
    t.main([("--source", {"required": True})])
