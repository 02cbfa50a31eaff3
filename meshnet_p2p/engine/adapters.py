"""Architecture adapters: which models may be cut into layer shards, and how.

Cutting renumbers blocks from 0: a shard of layers [10, 20) runs them as its
layers [0, 10), in a model llama.cpp believes has 10 layers. That is only
correct if nothing a layer computes depends on its index or on the layer count,
or if what does is carried. So an adapter says, per architecture:

- ``layer_indexed``: every property llama.cpp derives from a layer's global
  index, and how a shard carries it: as an explicit per-layer metadata array for
  the shard's span, holding exactly what the whole model uses for those layers
  (Gemma 3's sliding-window pattern: every sixth layer global by default, read
  from ``gemma3.attention.sliding_window_pattern`` when the file has it).
- ``layer_count_checks``: properties llama.cpp derives from the whole model's
  layer count that no key can carry; a file for which a shard would compute
  differently is refused, the reason named (a 62-layer Gemma 3 is "27B" to
  llama.cpp, which then scales attention by 1/sqrt(n_embd / n_head) instead of
  1/sqrt(head_dim); a shard of it has fewer layers and would not).

An architecture without an adapter is refused (Granite scales every input,
hidden states too, by a constant a middle shard would misapply), and the
adapter's id is part of the recipe.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Mapping

from meshnet_p2p.core.errors import MeshnetError
from .gguf import KV, GGUFFile, ValueType

_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


class UnsupportedArchitecture(MeshnetError):
    """No adapter exists for this architecture, so it cannot be cut safely."""

    def __init__(self, architecture: str, reason: str) -> None:
        self.architecture = architecture
        super().__init__(f"architecture {architecture!r} is not supported for layer sharding: {reason}")


class UncarriedLayerProperty(UnsupportedArchitecture):
    """The architecture has an adapter, but this file has a property a shard cannot carry."""

    def __init__(self, architecture: str, reason: str) -> None:
        self.architecture = architecture
        MeshnetError.__init__(self, f"this {architecture} model cannot be cut into layer shards: {reason}")


@dataclass(frozen=True)
class LayerIndexed:
    """A per-layer property llama.cpp derives from the layer's index in the whole
    model. A shard writes the whole model's values for its span to ``key_suffix``
    (``<arch>.`` before it) as an array of ``array_type``, which the pinned
    llama.cpp reads in preference to the index rule."""

    what: str
    key_suffix: str
    array_type: ValueType
    # (whole file, its arch, its layer count) -> the value of every layer as the whole
    # model uses it, or None when llama.cpp does not use the property for this file.
    # Raises UncarriedLayerProperty when the whole file's form cannot be reproduced.
    values: Callable[[GGUFFile, str, int], tuple | None]
    # (key suffix, value): a key of the whole file a shard sets to value when no
    # layer of its span has the property (its values all false)
    if_none_in_span: tuple[str, object] | None = None


# (whole file, arch, its layer count, the shard's layer count) -> None, or why that
# shard would compute differently from the same layers in the whole model
LayerCountCheck = Callable[[GGUFFile, str, int, int], "str | None"]


@dataclass(frozen=True)
class ArchitectureAdapter:
    """How one architecture's tensors split into per-block and shared parts."""

    architecture: str
    adapter_id: str  # a recipe axis: changing an adapter's behaviour must change this
    token_embd: str = "token_embd.weight"
    output_norm: str = "output_norm.weight"
    # The LM head: what only a tail uses. Every tensor the loader sizes by the
    # vocabulary must be here (a middle shard's vocabulary is one token): qwen2's
    # loader takes an optional output.bias of n_vocab, which a middle shard that
    # kept it could not load ("wrong shape; expected 1, got n_vocab").
    lm_head: tuple[str, ...] = ("output.weight", "output.bias")
    layer_indexed: tuple[LayerIndexed, ...] = ()
    layer_count_checks: tuple[LayerCountCheck, ...] = ()

    def block_of(self, tensor_name: str) -> tuple[int, str] | None:
        """``(layer index, rest of name)`` for a per-block tensor, else None."""
        m = _BLOCK.match(tensor_name)
        return (int(m.group(1)), m.group(2)) if m else None

    def key(self, suffix: str) -> str:
        return f"{self.architecture}.{suffix}"

    def per_layer_metadata(self, src: GGUFFile, n_layer: int, start: int, end: int) -> dict[str, KV]:
        """{key: its metadata entry} for each layer-indexed property the
        whole model uses: what the shard of layers [start, end) must carry (the
        values of layers start..end-1 in the whole model). Raises
        :class:`UncarriedLayerProperty` if that shard cannot compute what its
        layers compute in the whole model."""
        for check in self.layer_count_checks:
            reason = check(src, self.architecture, n_layer, end - start)
            if reason:
                raise UncarriedLayerProperty(self.architecture, reason)
        out: dict[str, KV] = {}
        for prop in self.layer_indexed:
            values = prop.values(src, self.architecture, n_layer)
            if values is None:
                continue
            assert len(values) == n_layer, prop.what
            span = tuple(values[start:end])
            key = self.key(prop.key_suffix)
            out[key] = KV(key, ValueType.ARRAY, span, prop.array_type)
            if prop.if_none_in_span is not None and not any(span):
                suffix, value = prop.if_none_in_span
                entry = src.kv[self.key(suffix)]
                out[entry.key] = KV(entry.key, entry.type, value)
        return out


def _uint(src: GGUFFile, key: str, what: str, arch: str) -> int | None:
    entry = src.kv.get(key)
    if entry is None:
        return None
    if entry.type not in (ValueType.UINT32, ValueType.INT32, ValueType.UINT64) or entry.value < 0:
        raise UncarriedLayerProperty(arch, f"its {key} ({what}) is not a non-negative integer")
    return int(entry.value)


def swa_pattern(n_pattern: int, dense_first: bool = False) -> Callable[[GGUFFile, str, int], tuple | None]:
    """Which layers use sliding-window attention, as the pinned llama.cpp's
    ``load_swa_pattern(ml, n_pattern, dense_first)`` decides for the whole model
    (src/llama-model.cpp; called only when ``<arch>.attention.sliding_window`` > 0):
    the per-layer array ``<arch>.attention.sliding_window_pattern`` as is if the
    file has one, else that key as an integer period, else ``n_pattern``, expanded
    by ``llama_hparams::set_swa_pattern`` (period 0: every layer sliding; else
    dense_first: layer il % p == 0 global; otherwise il % p == p - 1 global)."""

    def values(src: GGUFFile, arch: str, n_layer: int) -> tuple | None:
        if not _uint(src, f"{arch}.attention.sliding_window", "the sliding window", arch):
            return None  # no window: llama.cpp reads no pattern, every layer attends globally
        key = f"{arch}.attention.sliding_window_pattern"
        entry = src.kv.get(key)
        if entry is not None and entry.type is ValueType.ARRAY:
            if entry.array_type not in (ValueType.BOOL, ValueType.UINT32, ValueType.INT32):
                raise UncarriedLayerProperty(arch, f"its {key} is an array of {entry.array_type.name}, which llama.cpp does not read")
            if len(entry.value) != n_layer:
                raise UncarriedLayerProperty(
                    arch, f"its {key} has {len(entry.value)} entries for {n_layer} layers, so which layers slide is not per layer"
                )
            return tuple(bool(v) for v in entry.value)
        period = _uint(src, key, "the sliding-window period", arch)
        p = n_pattern if period is None else period
        if p == 0:
            return (True,) * n_layer
        if dense_first:
            return tuple(il % p != 0 for il in range(n_layer))
        return tuple(il % p < p - 1 for il in range(n_layer))

    return values


def gemma_attention_scale_by_type(big_model_layers: int) -> LayerCountCheck:
    """Gemma 2 / 3: llama.cpp's load_arch_hparams names the model type from the layer
    count and, for the 27B only (``big_model_layers`` layers), scales queries by
    1/sqrt(n_embd / n_head(0)) (integer division) instead of 1/sqrt(head_dim). No key
    overrides it (f_attention_scale is assigned unconditionally), so where the two
    differ, a shard whose layer count is "27B" and a whole model's is not (or the
    other way round: every shard of a 27B) would scale differently, and is refused."""

    def check(src: GGUFFile, arch: str, n_layer: int, shard_layers: int) -> str | None:
        if (n_layer == big_model_layers) == (shard_layers == big_model_layers):
            return None
        n_embd = int(src.get(f"{arch}.embedding_length"))
        heads = src.get(f"{arch}.attention.head_count")
        n_head = int(heads[0] if isinstance(heads, (tuple, list)) else heads or 0)
        head_dim = src.get(f"{arch}.attention.key_length") or (n_embd // n_head if n_head else 0)
        if n_head and n_embd // n_head == head_dim:
            return None  # the same scale either way
        big = n_layer if n_layer == big_model_layers else shard_layers
        return (
            f"llama.cpp takes a {big}-layer {arch} for the 27B and scales its attention by "
            f"1/sqrt(n_embd / n_head) = 1/sqrt({n_embd // n_head if n_head else '?'}), any other layer count by "
            f"1/sqrt(head_dim) = 1/sqrt({head_dim}); a shard of {shard_layers} of the {n_layer} layers would use "
            "the other scale, and no GGUF key sets it"
        )

    return check


_SLIDING_WINDOW = "sliding-window attention per layer (and with it the SWA RoPE base and scale)"

_PLAIN = ("llama", "mistral3", "qwen2", "qwen3")

# Architectures whose graphs we read (llama.cpp src/models/*.cpp). The plain ones
# have no layer-index behaviour: blocks are self-contained, RoPE depends on
# position only, the optional rope_freqs tensor is shared by every layer.
# Gemma 3 (src/models/gemma3.cpp): the sliding-window pattern is per layer by
# index (carried); the SWA layers' RoPE base and scale follow it (global keys);
# the sqrt(n_embd) input scale applies to token input only (a head's), not to
# hidden states fed as embeddings; the final logit softcap is a global key; the
# attention scale depends on the layer count (checked).
_SUPPORTED: Mapping[str, ArchitectureAdapter] = {
    **{arch: ArchitectureAdapter(arch, f"{arch}.v1") for arch in _PLAIN},
    "gemma3": ArchitectureAdapter(
        "gemma3",
        "gemma3.v1",
        layer_indexed=(
            LayerIndexed(
                _SLIDING_WINDOW,
                "attention.sliding_window_pattern",
                ValueType.BOOL,
                swa_pattern(6),
                # llama.cpp aborts the process (create_memory: GGML_ASSERT(is_swa_any()))
                # for a model with a window but no sliding layer: a shard of only global
                # layers is written as a model without a window, which runs every layer
                # as the whole model runs its global ones (the non-SWA graph, the
                # model's own RoPE base, a plain causal mask).
                if_none_in_span=("attention.sliding_window", 0),
            ),
        ),
        layer_count_checks=(gemma_attention_scale_by_type(62),),
    ),
}

# Known reasons for refusing, so the error says what an adapter would need.
_KNOWN_REFUSALS: Mapping[str, str] = {
    "gemma2": "it alternates sliding-window and global attention by layer index",
    "gemma3n": "its per-layer embeddings and sliding-window pattern depend on the layer index",
    "granite": "it scales every input, hidden states included, by an embedding multiplier that non-head shards would misapply",
    "cohere2": "its sliding-window pattern depends on the layer index",
    "llama4": "its no-RoPE layers are chosen by layer index",
}


def adapter_for(architecture: str) -> ArchitectureAdapter:
    """The adapter for ``architecture``, or :class:`UnsupportedArchitecture` naming it."""
    adapter = _SUPPORTED.get(architecture)
    if adapter is not None:
        return adapter
    reason = _KNOWN_REFUSALS.get(architecture, "no adapter has been written and checked for it")
    raise UnsupportedArchitecture(architecture, reason + f" (supported: {', '.join(sorted(_SUPPORTED))})")


def supported_architectures() -> tuple[str, ...]:
    return tuple(sorted(_SUPPORTED))
