# The only reason this file exists: a tiny C extension (the llama.cpp scheduler
# hooks) that setuptools cannot declare in pyproject.toml alone.
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "meshnet_p2p.engine._llama_hooks",
            sources=["meshnet_p2p/engine/_llama_hooks.c"],
            extra_compile_args=["-O2", "-fvisibility=hidden"],
        )
    ]
)
