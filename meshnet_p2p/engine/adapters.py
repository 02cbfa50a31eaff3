"""Architecture adapters: which models may be cut into layer shards, and how.

Cutting renumbers blocks from 0. That is only correct for architectures whose
layers do not change behaviour with their index: a shard of layers [10, 20)
runs them as its layers [0, 10). An architecture that decides something from
the layer index (Gemma 3's sliding-window pattern, every sixth layer global) or
that scales every input by a constant (Granite's embedding multiplier, which a
middle shard would wrongly apply to hidden states) would run, produce tokens,
and be silently wrong. So an architecture is refused unless an adapter here
says what its tensors are, and the adapter's id is part of the recipe.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from meshnet_p2p.core.errors import MeshnetError

_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


class UnsupportedArchitecture(MeshnetError):
    """No adapter exists for this architecture, so it cannot be cut safely."""

    def __init__(self, architecture: str, reason: str) -> None:
        self.architecture = architecture
        super().__init__(f"architecture {architecture!r} is not supported for layer sharding: {reason}")


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

    def block_of(self, tensor_name: str) -> tuple[int, str] | None:
        """``(layer index, rest of name)`` for a per-block tensor, else None."""
        m = _BLOCK.match(tensor_name)
        return (int(m.group(1)), m.group(2)) if m else None

    def key(self, suffix: str) -> str:
        return f"{self.architecture}.{suffix}"


# Architectures whose graphs we read and found free of layer-index behaviour
# (llama.cpp src/models/*.cpp): blocks are self-contained, RoPE depends on
# position only, the optional rope_freqs tensor is shared by every layer.
_SUPPORTED: Mapping[str, ArchitectureAdapter] = {
    arch: ArchitectureAdapter(arch, f"{arch}.v1")
    for arch in ("llama", "mistral3", "qwen2", "qwen3")
}

# Known reasons for refusing, so the error says what an adapter would need.
_KNOWN_REFUSALS: Mapping[str, str] = {
    "gemma3": "its sliding-window attention pattern is chosen by layer index (il % 6), so renumbered layers would attend wrongly",
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
