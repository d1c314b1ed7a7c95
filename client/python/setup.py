"""Builds the package with its pagedattn.v1 stubs, generated here from the repository's
proto/pagedattn/v1/pagedattn.proto by protoc and grpc_python_plugin (Debian: protobuf-compiler,
protobuf-compiler-grpc). Overrides: PAGEDATTN_PROTO_DIR (the folder holding pagedattn/v1/),
PROTOC, GRPC_PYTHON_PLUGIN. Metadata is in pyproject.toml."""

import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO = os.path.join("pagedattn", "v1", "pagedattn.proto")


def _tool(env, name):
    path = os.environ.get(env) or shutil.which(name)
    if not path:
        raise SystemExit(f"pagedattn: {name} not found (install protobuf-compiler and "
                         f"protobuf-compiler-grpc, or set {env})")
    return path


class BuildWithStubs(build_py):
    def run(self):
        super().run()
        proto_dir = os.environ.get("PAGEDATTN_PROTO_DIR") or os.path.join(HERE, "..", "..", "proto")
        if not os.path.isfile(os.path.join(proto_dir, PROTO)):
            raise SystemExit(f"pagedattn: {PROTO} not found under {os.path.abspath(proto_dir)}; "
                             "install from the repository (pip install client/python) or set "
                             "PAGEDATTN_PROTO_DIR")
        os.makedirs(self.build_lib, exist_ok=True)
        plugin = _tool("GRPC_PYTHON_PLUGIN", "grpc_python_plugin")
        subprocess.run([_tool("PROTOC", "protoc"), f"-I{proto_dir}",
                        f"--python_out={self.build_lib}", f"--grpc_out={self.build_lib}",
                        f"--plugin=protoc-gen-grpc={plugin}", os.path.join(proto_dir, PROTO)],
                       check=True)


setup(cmdclass={"build_py": BuildWithStubs})
