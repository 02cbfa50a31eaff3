"""Exact identity of what a shard computes: the model artifact and the runtime recipe.

Two shards that disagree on anything that moves the numbers still run and
still emit tokens, just the wrong ones. So identity is a digest over the
numerically live axes, each under its own name, never a model name:

- the **model digest** commits to the whole source file's sha256, its
  architecture and layer count. A shard routes under its source's identity
  (the shard's own bytes differ per range); the range is not part of identity.
- the **recipe digest** commits to each recipe axis separately: seam dtype,
  micro-batch size (llama.cpp's n_ubatch changes the numbers), KV dtype,
  attention kernel, architecture adapter, backend and runtime version.

Labels (a recipe's name) are not digested: renaming changes no number.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any, Mapping

MODEL_DOMAIN = "meshnet.model-artifact.v1"
RECIPE_DOMAIN = "meshnet.runtime-recipe.v1"


def _digest(domain: str, body: Mapping[str, Any]) -> str:
    doc = json.dumps({"domain": domain, "body": dict(body)}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(doc.encode()).hexdigest()


def model_digest(source_sha256: str, architecture: str, n_layer: int) -> str:
    return _digest(MODEL_DOMAIN, {"source_sha256": source_sha256, "architecture": architecture, "n_layer": n_layer})


@dataclass(frozen=True)
class Recipe:
    seam_dtype: str
    n_ubatch: int
    kv_dtype: str
    flash_attn: bool
    adapter_id: str
    backend: str
    runtime_version: str

    def axes(self) -> dict[str, Any]:
        return asdict(self)

    def digest(self) -> str:
        return _digest(RECIPE_DOMAIN, self.axes())


def explain_mismatch(mine: Mapping[str, Any], theirs: Mapping[str, Any]) -> list[str]:
    """Every recipe axis on which two recipes differ, as readable reasons."""
    reasons = []
    for axis in sorted(set(mine) | set(theirs)):
        if mine.get(axis) != theirs.get(axis):
            reasons.append(f"{axis} is {theirs.get(axis)!r} there, {mine.get(axis)!r} here")
    return reasons
