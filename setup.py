# setup.py exists for two build steps pyproject.toml cannot declare alone:
# the C extension with the llama.cpp scheduler hooks, and the gRPC code that
# is generated from proto/ at build time (never edited, never committed).
import os

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PROTOS = ["shard_runtime.proto", "weights.proto"]


def generate_grpc() -> None:
    from grpc_tools import protoc  # a build requirement (pyproject.toml)

    out = os.path.join(HERE, "meshnet_p2p", "_proto")
    os.makedirs(out, exist_ok=True)
    open(os.path.join(out, "__init__.py"), "a").close()
    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    for name in PROTOS:
        # The virtual include path makes generated imports package-absolute.
        rc = protoc.main([
            "grpc_tools.protoc",
            f"-Imeshnet_p2p/_proto={os.path.join(HERE, 'proto')}",
            f"-I{include}",
            f"--python_out={HERE}",
            f"--grpc_python_out={HERE}",
            f"meshnet_p2p/_proto/{name}",
        ])
        if rc != 0:
            raise RuntimeError(f"protoc failed on proto/{name}")


class BuildPyWithProtos(build_py):
    def run(self):
        generate_grpc()
        super().run()


setup(
    cmdclass={"build_py": BuildPyWithProtos},
    ext_modules=[
        Extension(
            "meshnet_p2p.engine._llama_hooks",
            sources=["meshnet_p2p/engine/_llama_hooks.c"],
            extra_compile_args=["-O2", "-fvisibility=hidden"],
        ),
        # idle-priority spinning threads that keep CPUs awake between a session's steps (engine/keepwarm.py)
        Extension(
            "meshnet_p2p.engine._keepwarm",
            sources=["meshnet_p2p/engine/_keepwarm.c"],
            extra_compile_args=["-O2", "-fvisibility=hidden"],
            libraries=["pthread"],
        ),
    ],
)
