"""Exact identity of what a shard computes: the model artifact and the runtime recipe.

Two shards that disagree on anything that moves the numbers still run and
still emit tokens, just the wrong ones. So identity is a digest over the
numerically live axes, each under its own name, never a model name:

- the **model digest** commits to the whole source file's sha256, its
  architecture and layer count. A shard routes under its source's identity
  (the shard's own bytes differ per range); the range is not part of identity.
- the **recipe digest** commits to each axis of :data:`RECIPE_AXES`
  separately. Every axis is derived from what runs: the loaded file's
  metadata, the context parameters the engine set, and what llama.cpp/ggml
  report of themselves (version, commit, the CPU kernels they selected).
  No axis comes from a flag or a configured name.

Labels (``recipe_name``, ``recipe_version``) ride beside the axes and are not
digested: renaming changes no number.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, fields
from typing import Any, Mapping

from gguf import GGMLQuantizationType, LlamaFileType

MODEL_DOMAIN = "meshnet.model-artifact.v1"
RECIPE_DOMAIN = "meshnet.runtime-recipe.v2"
TOKENIZER_DOMAIN = "meshnet.tokenizer.v1"

# The numerically live axes, each digested under its own key. Adding one here
# without a conformance vector (tests/data/recipe_vectors.json) fails the tests.
RECIPE_AXES = (
    "weight_quantization",
    "seam_dtype",
    "compute_dtype",
    "kv_dtype",
    "kv_layout",
    "flash_attn",
    "n_ubatch",
    "tokenizer_digest",
    "adapter_id",
    "backend",
    "llama_build",
    "cpu_features",
    "boundary_schema_version",
    "protocol_schema_version",
)
RECIPE_LABELS = ("recipe_name", "recipe_version")

# --- what the engine runs (llama_engine sets these; the recipe names them) ---

BACKEND = "llama.cpp-cpu"
COMPUTE_DTYPE = "f32"  # ggml's CPU backend accumulates matmuls and norms in float32
KV_CACHE_GGML_TYPE = int(GGMLQuantizationType.F16)  # set as cparams.type_k and type_v
FLASH_ATTN_TYPE = 0  # LLAMA_FLASH_ATTN_TYPE_DISABLED (AUTO enables it on these CPUs)
KV_UNIFIED = False  # one KV stream per sequence: sessions never share attention numerics
BOUNDARY_SCHEMA_VERSION = 1  # the hidden-state bundle crossing a seam
PROTOCOL_SCHEMA_VERSION = 1  # the shard runtime wire protocol

DEFAULT_RECIPE_NAME = "default"
DEFAULT_RECIPE_VERSION = "1"

_FLASH_ATTN_TYPES = {-1: None, 0: False, 1: True}  # AUTO has no fixed answer: refused
# The KV cache types a recipe can name (llama.cpp's CPU backend supports these), by their ggml names.
_KV_TYPES = {int(GGMLQuantizationType[n]): n.lower() for n in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL")}

# llama.cpp's enum llama_ftype (general.file_type) -> name ("Q4_K_M"), from gguf-py.
# Gaps are removed types; a type newer than the pinned gguf-py is named "ftype-<n>"
# (tests/test_recipe.py checks that the reader refuses such a file's tensors anyway).
LLAMA_FTYPE_GUESSED = int(LlamaFileType.GUESSED)
LLAMA_FTYPES: Mapping[int, str] = {
    int(t): t.name.removeprefix("MOSTLY_").removeprefix("ALL_") for t in LlamaFileType if t is not LlamaFileType.GUESSED
}


class RecipeError(ValueError):
    """A recipe axis has no well-defined value (a wrong type, or a setting with no fixed meaning)."""


def _digest(domain: str, body: Mapping[str, Any]) -> str:
    doc = json.dumps({"domain": domain, "body": dict(body)}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(doc.encode()).hexdigest()


def model_digest(source_sha256: str, architecture: str, n_layer: int) -> str:
    return _digest(MODEL_DOMAIN, {"source_sha256": source_sha256, "architecture": architecture, "n_layer": n_layer})


def ftype_name(file_type: int | None) -> str:
    """``general.file_type`` -> its llama_ftype name ("Q4_1"); unknown ints as "ftype-<n>"."""
    if file_type is None:
        return "unspecified"
    if isinstance(file_type, bool) or not isinstance(file_type, int):
        raise RecipeError(f"general.file_type {file_type!r} is not an integer")
    name = LLAMA_FTYPES.get(file_type)
    if name is None and file_type & LLAMA_FTYPE_GUESSED:
        base = LLAMA_FTYPES.get(file_type & ~LLAMA_FTYPE_GUESSED)
        name = f"{base} (guessed)" if base else None
    return name or f"ftype-{file_type}"


def kv_dtype_name(ggml_type: int) -> str:
    try:
        return _KV_TYPES[ggml_type]
    except KeyError:
        raise RecipeError(f"KV cache ggml type {ggml_type} has no recipe name") from None


def flash_attn_enabled(flash_attn_type: int) -> bool:
    value = _FLASH_ATTN_TYPES.get(flash_attn_type)
    if value is None:
        raise RecipeError(f"flash_attn_type {flash_attn_type} does not fix the attention kernel (AUTO or unknown)")
    return value


def kv_layout_name(kv_unified: bool) -> str:
    return "unified" if kv_unified else "per-sequence"


_FEATURE = re.compile(r"([A-Za-z0-9_]+)\s*=\s*([^|\s]*)")


def parse_cpu_features(system_info: str) -> str:
    """The CPU features ggml reports as selected (value 1) in
    ``llama_print_system_info()``, sorted and comma-joined.

    The text is ``"<BACKEND> : NAME = V | NAME = V | ... "`` per backend; only
    the CPU backend's section counts here.
    """
    section: str | None = None
    on: set[str] = set()
    for part in system_info.split("|"):
        if ":" in part:
            section, _, part = part.partition(":")
            section = section.strip()
        m = _FEATURE.search(part)
        if m and section == "CPU" and m.group(2) == "1":
            on.add(m.group(1))
    if not on:
        raise RecipeError(f"ggml reports no CPU features in {system_info!r}")
    return ",".join(sorted(on))


_AXIS_TYPES: Mapping[str, type] = {
    "flash_attn": bool,
    "n_ubatch": int,
    "boundary_schema_version": int,
    "protocol_schema_version": int,
}


@dataclass(frozen=True)
class Recipe:
    weight_quantization: str
    seam_dtype: str
    compute_dtype: str
    kv_dtype: str
    kv_layout: str
    flash_attn: bool
    n_ubatch: int
    tokenizer_digest: str
    adapter_id: str
    backend: str
    llama_build: str
    cpu_features: str
    boundary_schema_version: int
    protocol_schema_version: int
    # labels: not digested
    recipe_name: str = DEFAULT_RECIPE_NAME
    recipe_version: str = DEFAULT_RECIPE_VERSION

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            want = _AXIS_TYPES.get(f.name, str)
            # bool is an int in Python; an axis is exactly one of them.
            if type(value) is not want:
                raise RecipeError(f"recipe axis {f.name} must be {want.__name__}, got {value!r}")
            if want is str and not value:
                raise RecipeError(f"recipe axis {f.name} is empty")

    def axes(self) -> dict[str, Any]:
        return {axis: getattr(self, axis) for axis in RECIPE_AXES}

    def labels(self) -> dict[str, Any]:
        return {label: getattr(self, label) for label in RECIPE_LABELS}

    def digest(self) -> str:
        return recipe_digest(self.axes())


def recipe_digest(axes: Mapping[str, Any]) -> str:
    """The digest of exactly the axes of :data:`RECIPE_AXES` (others are refused)."""
    if set(axes) != set(RECIPE_AXES):
        missing, extra = set(RECIPE_AXES) - set(axes), set(axes) - set(RECIPE_AXES)
        raise RecipeError(f"recipe axes differ from RECIPE_AXES: missing {sorted(missing)}, unknown {sorted(extra)}")
    return _digest(RECIPE_DOMAIN, axes)


def runtime_recipe(
    *,
    seam_dtype: str,
    n_ubatch: int,
    weight_quantization: str,
    tokenizer_digest: str,
    adapter_id: str,
    kv_ggml_type: int = KV_CACHE_GGML_TYPE,
    flash_attn_type: int = FLASH_ATTN_TYPE,
    kv_unified: bool = KV_UNIFIED,
    recipe_name: str = DEFAULT_RECIPE_NAME,
    recipe_version: str = DEFAULT_RECIPE_VERSION,
) -> Recipe:
    """The recipe of this process: the given per-load axes, plus the build and
    CPU features llama.cpp/ggml report and the context settings (the engine
    passes the values it actually set in its context parameters)."""
    from .llama_native import native_build, system_info  # imports llama_cpp: only when running

    return Recipe(
        weight_quantization=weight_quantization,
        seam_dtype=seam_dtype,
        compute_dtype=COMPUTE_DTYPE,
        kv_dtype=kv_dtype_name(kv_ggml_type),
        kv_layout=kv_layout_name(bool(kv_unified)),
        flash_attn=flash_attn_enabled(flash_attn_type),
        n_ubatch=n_ubatch,
        tokenizer_digest=tokenizer_digest,
        adapter_id=adapter_id,
        backend=BACKEND,
        llama_build=native_build(),
        cpu_features=parse_cpu_features(system_info()),
        boundary_schema_version=BOUNDARY_SCHEMA_VERSION,
        protocol_schema_version=PROTOCOL_SCHEMA_VERSION,
        recipe_name=recipe_name,
        recipe_version=recipe_version,
    )


def differing_axes(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """The names of the axes on which two recipes differ (a missing axis differs)."""
    return [axis for axis in sorted(set(a) | set(b)) if axis not in a or axis not in b or a[axis] != b[axis]]


def explain_mismatch(mine: Mapping[str, Any], theirs: Mapping[str, Any]) -> list[str]:
    """Every recipe axis on which two recipes differ, as readable reasons."""
    return [f"{axis} is {theirs.get(axis)!r} there, {mine.get(axis)!r} here" for axis in differing_axes(mine, theirs)]
