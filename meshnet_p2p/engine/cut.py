"""Cutting a GGUF model into a shard of layers [start, end).

What a shard keeps (llama.cpp requires ``token_embd`` and ``output_norm`` in
every model file, so every shard carries them in some form):

- head (start == 0): tokenizer, the real ``token_embd``, ``output_norm``; the
  LM head (an untied ``output`` matrix, an ``output.bias``) is dropped (a head
  never computes logits, and llama.cpp falls back to ``token_embd`` for it).
- tail (end == n_layer): tokenizer, ``token_embd``, ``output_norm``, the LM head.
- middle: slim: a one-row dummy ``token_embd``, ``output_norm``, and a
  ``none`` tokenizer with ``<arch>.vocab_size = 1`` (no vocabulary at all), no
  LM head (llama.cpp sizes it by the vocabulary: one token here).

Blocks are copied with their raw (quantized) bytes, renumbered from 0. What
llama.cpp derives from a layer's global index (Gemma 3's sliding-window layers)
is written as an explicit per-layer array for the shard's span, as the adapter
says (adapters.py); what no key can carry is refused before anything is written.
Every
shard records where it came from in ``meshnet.*`` keys: the sha256 of the whole
source file, the source's layer count and the range, so a shard stays bound to
the exact artifact it was cut from, and the source's tokenizer digest (a middle
shard has no tokenizer of its own, yet its recipe names the source's).

A shard also carries its binding, ``meshnet.shard.data_sha256``: a
domain-separated sha256 over every byte of the file except that one metadata
entry (header, all other metadata, tensor infos, tensor data, padding). It is
checked on every inspect, so a shard whose bytes changed after cutting (a
flipped bit, a truncation, an edited key) is refused before it is served.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from typing import Callable, Iterable

from gguf import GGMLQuantizationType

from meshnet_p2p.core.errors import MeshnetError
from .adapters import ArchitectureAdapter, adapter_for
from .gguf import (
    KV,
    GGUFFile,
    GGUFFormatError,
    KVEntry,
    OutTensor,
    TensorInfo,
    ValueType,
    encode_string,
    read_gguf,
    read_range,
    write_gguf,
    written_atomically,
)
from .recipe import TOKENIZER_DOMAIN, ftype_name, model_digest

SHARD_FORMAT_VERSION = 2
K_FORMAT = "meshnet.format_version"
K_SOURCE_SHA256 = "meshnet.source.sha256"
K_SOURCE_LAYERS = "meshnet.source.block_count"
K_SOURCE_SIZE = "meshnet.source.file_size"
K_SOURCE_NAME = "meshnet.source.name"
K_START = "meshnet.shard.start"
K_END = "meshnet.shard.end"
K_ROLE = "meshnet.shard.role"
K_ADAPTER = "meshnet.adapter"
K_SOURCE_TOKENIZER = "meshnet.source.tokenizer_sha256"
K_DATA_SHA256 = "meshnet.shard.data_sha256"
K_FILE_TYPE = "general.file_type"
BINDING_DOMAIN = "meshnet.shard-binding.v1"
_UNBOUND = "0" * 64  # the binding's placeholder while the shard is being written

Progress = Callable[[str, int, int], None]  # (phase, done, total)


class ShardCutError(MeshnetError):
    """A shard cannot be cut (or loaded) as asked."""


class LayerRangeError(ShardCutError):
    """The layer range is empty or lies outside the model."""


class ShardBindingError(ShardCutError):
    """A shard's bytes do not match the binding it claims (or it claims none)."""

    def __init__(self, path: str, detail: str) -> None:
        super().__init__(f"{path}: shard bytes do not match the binding it claims: {detail}")


@dataclass(frozen=True)
class ShardInfo:
    """What a GGUF file is, in shard terms. An uncut model is the range [0, n_layer)."""

    path: str
    architecture: str
    adapter_id: str
    source_sha256: str
    source_layers: int
    start: int
    end: int
    n_embd: int
    is_cut: bool
    tokenizer_digest: str = ""  # the SOURCE model's tokenizer (a recipe axis), the same for every shard
    weight_quantization: str = ""  # general.file_type by name ("Q4_1"), a recipe axis
    data_sha256: str | None = None  # a cut shard's verified binding; None for an uncut model

    @property
    def is_head(self) -> bool:
        return self.start == 0

    @property
    def is_tail(self) -> bool:
        return self.end == self.source_layers

    @property
    def role(self) -> str:
        return role_of(self.start, self.end, self.source_layers)

    @property
    def n_layers(self) -> int:
        return self.end - self.start

    @property
    def model_digest(self) -> str:
        """The model's identity on the network (the same for every shard of it)."""
        return model_digest(self.source_sha256, self.architecture, self.source_layers)


def role_of(start: int, end: int, n_layer: int) -> str:
    if start == 0 and end == n_layer:
        return "whole"
    return "head" if start == 0 else "tail" if end == n_layer else "middle"


def parse_layer_range(text: str) -> tuple[int, int]:
    """``"A:B"`` -> (A, B). Raises :class:`LayerRangeError` on anything else."""
    parts = text.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise LayerRangeError(f"layer range {text!r} is not of the form A:B (e.g. 10:20)")
    start, end = int(parts[0]), int(parts[1])
    if end <= start:
        raise LayerRangeError(f"layer range {text!r} is empty: B must be greater than A")
    return start, end


def sha256_file(path: str, progress: Progress | None = None) -> str:
    h = hashlib.sha256()
    total = os.path.getsize(path)
    done = 0
    with open(path, "rb") as f:
        while chunk := f.read(4 << 20):
            h.update(chunk)
            done += len(chunk)
            if progress:
                progress("hashing", done, total)
    return h.hexdigest()


def _model_shape(src: GGUFFile) -> tuple[str, ArchitectureAdapter, int, int]:
    arch = src.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise GGUFFormatError(f"{os.path.basename(src.path)}: no general.architecture key")
    adapter = adapter_for(arch)
    n_layer = src.get(adapter.key("block_count"))
    n_embd = src.get(adapter.key("embedding_length"))
    if not isinstance(n_layer, int) or n_layer <= 0 or not isinstance(n_embd, int) or n_embd <= 0:
        raise GGUFFormatError(f"{os.path.basename(src.path)}: missing or bad {arch}.block_count / embedding_length")
    return arch, adapter, n_layer, n_embd


def _is_hex64(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def tokenizer_digest(src: GGUFFile) -> str:
    """sha256 (domain-separated) over every ``tokenizer.*`` metadata entry of a
    file, each as its GGUF encoding (key, value type, value), sorted by key."""
    keys = sorted(k for k in src.kv if k.startswith("tokenizer."))
    h = hashlib.sha256(encode_string(TOKENIZER_DOMAIN) + struct.pack("<Q", len(keys)))
    with open(src.path, "rb") as f:
        for key in keys:
            start, end = src.kv[key].span
            f.seek(start)
            h.update(f.read(end - start))
    return h.hexdigest()


def _binding_digest(path: str, skip: tuple[int, int], progress: Progress | None = None) -> str:
    """sha256 (domain-separated) over the file's bytes, the span ``skip`` left out."""
    h = hashlib.sha256(encode_string(BINDING_DOMAIN))
    total = os.path.getsize(path)
    done = 0
    with open(path, "rb") as f:
        for lo, hi in ((0, skip[0]), (skip[1], total)):
            for chunk in read_range(f, lo, hi - lo, short=f"{path}: file ended while hashing it"):
                h.update(chunk)
                done += len(chunk)
                if progress:
                    progress("binding", done, total)
    return h.hexdigest()


def verify_shard(path: str, src: GGUFFile | None = None) -> str:
    """Check a cut shard's bytes against the binding it claims; return the binding.
    Raises :class:`ShardBindingError` if it claims none or its bytes differ."""
    src = src or read_gguf(path)
    entry = src.kv.get(K_DATA_SHA256)
    if entry is None:
        raise ShardBindingError(path, f"no {K_DATA_SHA256} key")
    if entry.type is not ValueType.STRING or not _is_hex64(entry.value) or entry.value == _UNBOUND:
        raise ShardBindingError(path, f"{K_DATA_SHA256} is not a sha256 hex digest")
    actual = _binding_digest(path, entry.span)
    if actual != entry.value:
        raise ShardBindingError(path, f"{K_DATA_SHA256} says {entry.value}, the bytes hash to {actual}")
    return actual


def inspect_gguf(path: str, *, source_sha256: str | None = None, verify: bool = True) -> ShardInfo:
    """Read a model or shard file's shard identity. For an uncut model the source
    digest is the file's own sha256 (computed unless given). A cut shard's
    binding is checked (:func:`verify_shard`) unless ``verify`` is false."""
    src = read_gguf(path)
    arch, adapter, n_layer, n_embd = _model_shape(src)
    try:
        quantization = ftype_name(src.get(K_FILE_TYPE))
    except ValueError as e:
        raise ShardCutError(f"{path}: {e}") from None
    if K_SOURCE_SHA256 in src.kv:
        try:
            version = src.get(K_FORMAT)
            if version != SHARD_FORMAT_VERSION:
                raise ShardCutError(f"{path}: shard format version {version!r}, this build reads {SHARD_FORMAT_VERSION}")
            start, end, total = int(src.get(K_START)), int(src.get(K_END)), int(src.get(K_SOURCE_LAYERS))
            digest = str(src.get(K_SOURCE_SHA256))
            tokenizer = src.get(K_SOURCE_TOKENIZER)
        except (TypeError, ValueError):
            raise ShardCutError(f"{path}: malformed meshnet.* shard metadata") from None
        if end - start != n_layer or not 0 <= start < end <= total or len(digest) != 64:
            raise ShardCutError(f"{path}: shard metadata says layers {start}:{end} of {total}, but the file holds {n_layer} layers")
        if not _is_hex64(tokenizer):
            raise ShardCutError(f"{path}: malformed {K_SOURCE_TOKENIZER}")
        binding = verify_shard(path, src) if verify else src.get(K_DATA_SHA256)
        if verify and (start == 0 or end == total) and tokenizer_digest(src) != tokenizer:
            # a head or tail tokenizes with its own copy: it must be the source's
            raise ShardBindingError(path, f"its tokenizer is not the source's ({K_SOURCE_TOKENIZER})")
        return ShardInfo(
            path, arch, adapter.adapter_id, digest, total, start, end, n_embd, True, tokenizer, quantization, binding
        )
    digest = source_sha256 or sha256_file(path)
    return ShardInfo(
        path, arch, adapter.adapter_id, digest, n_layer, 0, n_layer, n_embd, False, tokenizer_digest(src), quantization
    )


def cut_shard(
    model_path: str,
    start: int,
    end: int,
    out_path: str,
    *,
    source_sha256: str | None = None,
    progress: Progress | None = None,
) -> ShardInfo:
    """Write the shard of layers [start, end) of ``model_path`` to ``out_path``."""
    src = read_gguf(model_path)
    arch, adapter, n_layer, n_embd = _model_shape(src)
    if K_SOURCE_SHA256 in src.kv:
        raise ShardCutError(f"{model_path} is itself a shard (layers {src.get(K_START)}:{src.get(K_END)}); cut from the whole model")
    if not 0 <= start < end <= n_layer:
        raise LayerRangeError(f"layers {start}:{end} are outside the model, which has layers 0:{n_layer}")
    # Per-layer properties llama.cpp derives from the global layer index, as the
    # whole model uses them for layers start..end-1 (refused here, before any
    # hashing, if a shard cannot carry them).
    carried = adapter.per_layer_metadata(src, n_layer, start, end)
    digest = source_sha256 or sha256_file(model_path, progress)
    try:
        quantization = ftype_name(src.get(K_FILE_TYPE))  # copied verbatim into the shard below
    except ValueError as e:
        raise ShardCutError(f"{model_path}: {e}") from None
    source_tokenizer = tokenizer_digest(src)
    role = role_of(start, end, n_layer)
    head, tail = start == 0, end == n_layer

    kv: list[KV | KVEntry] = []
    for key in src.kv_order:
        entry = src.kv[key]
        if key == adapter.key("block_count"):
            kv.append(KV(key, entry.type, end - start))
        elif key in carried:
            continue  # written below, explicitly per layer
        elif key.startswith("meshnet."):
            continue
        elif not (head or tail) and (key.startswith("tokenizer.") or key == adapter.key("vocab_size")):
            continue  # a middle shard has no vocabulary
        elif (
            key.startswith(arch + ".")
            and entry.type is ValueType.ARRAY
            and entry.array_type is not ValueType.STRING
            and len(entry.value) == n_layer
        ):
            # Per-layer hyperparameters (head counts, FFN widths) follow their layers.
            kv.append(KV(key, entry.type, entry.value[start:end], entry.array_type))
        else:
            kv.append(entry)  # re-encoded from its value: the same bytes
    kv += carried.values()
    if not (head or tail):
        kv.append(KV("tokenizer.ggml.model", ValueType.STRING, "none"))
        kv.append(KV(adapter.key("vocab_size"), ValueType.UINT32, 1))
    kv += [
        KV(K_FORMAT, ValueType.UINT32, SHARD_FORMAT_VERSION),
        KV(K_SOURCE_SHA256, ValueType.STRING, digest),
        KV(K_SOURCE_LAYERS, ValueType.UINT32, n_layer),
        KV(K_SOURCE_SIZE, ValueType.UINT64, src.file_size),
        KV(K_SOURCE_NAME, ValueType.STRING, os.path.basename(model_path)),
        KV(K_START, ValueType.UINT32, start),
        KV(K_END, ValueType.UINT32, end),
        KV(K_ROLE, ValueType.STRING, role),
        KV(K_ADAPTER, ValueType.STRING, adapter.adapter_id),
        KV(K_SOURCE_TOKENIZER, ValueType.STRING, source_tokenizer),
        KV(K_DATA_SHA256, ValueType.STRING, _UNBOUND),  # filled in once the bytes are on disk
    ]

    tensors = [out for out, _ in _plan_tensors(src, adapter, start, end, n_embd, model_path)]

    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    binding = _write_bound(out_path, kv, tensors, model_path, src.alignment, progress)
    return ShardInfo(
        out_path, arch, adapter.adapter_id, digest, n_layer, start, end, n_embd, True, source_tokenizer, quantization, binding
    )


def _plan_tensors(src: GGUFFile, adapter: ArchitectureAdapter, start: int, end: int, n_embd: int,
                  what: str) -> list[tuple[OutTensor, "TensorInfo | None"]]:
    """The shard's tensors in order, each with the source tensor its bytes are copied
    from (None for a synthesised one)."""
    n_layer = src.get(adapter.key("block_count"))
    head, tail = start == 0, end == n_layer
    plan: list[tuple[OutTensor, TensorInfo | None]] = []
    for t in src.tensors:
        block = adapter.block_of(t.name)
        source_offset = src.data_offset + t.offset
        if block is not None:
            idx, rest = block
            if start <= idx < end:
                plan.append((OutTensor(f"blk.{idx - start}.{rest}", t.dims, t.ggml_type, t.nbytes, source_offset), t))
        elif t.name == adapter.token_embd and not (head or tail):
            dummy = struct.pack(f"<{n_embd}f", *([0.0] * n_embd))
            plan.append((OutTensor(t.name, (n_embd, 1), GGMLQuantizationType.F32, len(dummy), data=dummy), None))
        elif t.name in adapter.lm_head and not tail:
            continue
        else:
            plan.append((OutTensor(t.name, t.dims, t.ggml_type, t.nbytes, source_offset), t))
    if not any(adapter.block_of(out.name) for out, _ in plan):
        raise ShardCutError(f"{what}: no block tensors found for layers {start}:{end}")
    for needed in (adapter.token_embd, adapter.output_norm):
        if not any(out.name == needed for out, _ in plan):
            raise ShardCutError(f"{what}: the model has no {needed!r} tensor")
    return plan


def tensors_needed(src: GGUFFile, start: int, end: int) -> tuple[TensorInfo, ...]:
    """The source tensors whose bytes a shard of layers [start, end) copies: all that
    :func:`cut_shard` reads of the file besides its header (a fetcher needs no more)."""
    arch, adapter, n_layer, n_embd = _model_shape(src)
    if not 0 <= start < end <= n_layer:
        raise LayerRangeError(f"layers {start}:{end} are outside the model, which has layers 0:{n_layer}")
    return tuple(t for _, t in _plan_tensors(src, adapter, start, end, n_embd, src.path) if t is not None)


def _write_bound(
    out_path: str, kv: Iterable[KV | KVEntry], tensors: list[OutTensor], model_path: str, alignment: int, progress: Progress | None
) -> str:
    """Write the shard under a name of our own, hash what is on disk, write the
    binding over its placeholder (same length: no offset moves), then rename
    into place, so ``out_path`` only ever holds a whole, bound shard."""
    with written_atomically(out_path, "unbound") as tmp:
        write_gguf(
            tmp,
            kv,
            tensors,
            source_path=model_path,
            alignment=alignment,
            progress=(lambda d, t: progress("writing", d, t)) if progress else None,
        )
        span = read_gguf(tmp).kv[K_DATA_SHA256].span
        binding = _binding_digest(tmp, span, progress)
        with open(tmp, "r+b") as f:
            f.seek(span[1] - len(_UNBOUND))
            if f.read(len(_UNBOUND)) != _UNBOUND.encode():
                raise ShardCutError(f"{out_path}: the binding placeholder is not where the metadata says")
            f.seek(span[1] - len(_UNBOUND))
            f.write(binding.encode())
            f.flush()
            os.fsync(f.fileno())
    return binding
