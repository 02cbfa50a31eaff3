"""A model's manifest: what checks any part of a GGUF file without the whole file.

For one GGUF file: its name and size, the sha256 of its header (the magic,
metadata and tensor table, and the padding up to the data section: bytes
``[0, header_size)``), and for every tensor its name, ggml type, dims, offset
in the data section, length and sha256. The whole file's sha256 and the model
digest derived from it (recipe.model_digest) are in it too, so one digest
over the manifest (:meth:`Manifest.digest`) stands for the file: whoever holds
the file builds the manifest (:func:`build_manifest`, one pass), a certifier
signs its digest beside the model's (the trust layer), and a fetcher checks
the header and each tensor it fetches against it (:meth:`Manifest.check_header`,
:meth:`Manifest.check_tensor`), never anything it did not fetch.

A manifest from the network is checked whole before it is believed: every
field typed and bounded, tensors inside the file and not overlapping the header
or each other, the model digest the one its own fields derive. A header that
hashes right must still give the manifest's own tensor table, so a manifest
cannot describe a file other than the one its header heads.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import msgpack

from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.core.records import canonical, unpack_strict

from .gguf import GGML_MAX_DIMS, GGUFFile, GGUFFormatError, read_gguf, read_range, tensor_nbytes
from .recipe import model_digest

MANIFEST_DOMAIN = b"meshnet-model-manifest-v1\0"
MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 8 << 20  # ~100 bytes a tensor: far above any real model's tensor count
MAX_TENSORS = 1 << 16
MAX_TENSOR_NAME = 256  # ggml's GGML_MAX_NAME is 64
MAX_FILE_NAME = 255
MAX_FILE_SIZE = 1 << 50
MAX_HEADER = 1 << 30  # the header holds the vocabulary: a few MB in real models
MAX_DIM = 1 << 40
MAX_ARCH = 64

Progress = Callable[[str, int, int], None]  # (phase, done, total)


class ManifestError(MeshnetError):
    """A manifest that is malformed, inconsistent, or does not match the bytes checked against it."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    ggml_type: int
    dims: tuple[int, ...]  # GGUF order: ne0 first
    offset: int  # from the start of the data section
    nbytes: int
    sha256: bytes


@dataclass(frozen=True)
class Manifest:
    source_sha256: str  # the whole file's sha256 (hex)
    architecture: str
    n_layer: int
    file_name: str  # its basename: a shard records where it was cut from
    file_size: int
    header_size: int  # where the data section starts
    header_sha256: bytes
    tensors: tuple[TensorEntry, ...]

    def __post_init__(self) -> None:
        _check(self)

    @property
    def model_digest(self) -> str:
        """The model's identity on the network, derived (never claimed)."""
        return model_digest(self.source_sha256, self.architecture, self.n_layer)

    def digest(self) -> str:
        return hashlib.sha256(MANIFEST_DOMAIN + canonical(self.to_content())).hexdigest()

    def tensor(self, name: str) -> TensorEntry:
        for t in self.tensors:
            if t.name == name:
                return t
        raise ManifestError(f"the manifest of {self.file_name} has no tensor {name!r}")

    def span(self, t: TensorEntry) -> tuple[int, int]:
        """The tensor's byte range in the file."""
        return self.header_size + t.offset, self.header_size + t.offset + t.nbytes

    # --- checking fetched bytes ---------------------------------------------

    def check_header(self, header: bytes) -> GGUFFile:
        """The parsed header, if ``header`` is this file's; ManifestError otherwise."""
        if len(header) != self.header_size or hashlib.sha256(header).digest() != self.header_sha256:
            raise ManifestError(f"the header of {self.file_name} does not match its manifest")
        try:
            src = read_gguf(self.file_name, buf=header, file_size=self.file_size)
        except GGUFFormatError as e:
            raise ManifestError(f"the header of {self.file_name} does not parse: {e}") from None
        table = tuple((t.name, t.ggml_type, t.dims, t.offset, t.nbytes) for t in src.tensors)
        if src.data_offset != self.header_size or table != tuple(
            (t.name, t.ggml_type, t.dims, t.offset, t.nbytes) for t in self.tensors
        ):
            raise ManifestError(f"the header of {self.file_name} describes other tensors than its manifest")
        if src.get("general.architecture") != self.architecture:
            raise ManifestError(f"the header of {self.file_name} is not of architecture {self.architecture!r}")
        return src

    def check_tensor(self, name: str, data: bytes) -> TensorEntry:
        t = self.tensor(name)
        if len(data) != t.nbytes or hashlib.sha256(data).digest() != t.sha256:
            raise ManifestError(f"tensor {name!r} of {self.file_name} does not match its manifest")
        return t

    # --- encoding ------------------------------------------------------------

    def to_content(self) -> dict[str, Any]:
        return {
            "v": MANIFEST_VERSION,
            "source_sha256": self.source_sha256,
            "architecture": self.architecture,
            "n_layer": self.n_layer,
            "file_name": self.file_name,
            "file_size": self.file_size,
            "header_size": self.header_size,
            "header_sha256": self.header_sha256,
            "tensors": [[t.name, t.ggml_type, list(t.dims), t.offset, t.nbytes, t.sha256] for t in self.tensors],
        }

    def to_bytes(self) -> bytes:
        return canonical(self.to_content())

    @classmethod
    def from_content(cls, c: Any) -> "Manifest":
        """From decoded msgpack of anywhere: a Manifest, or ManifestError."""
        names = {"v", "source_sha256", "architecture", "n_layer", "file_name", "file_size", "header_size",
                 "header_sha256", "tensors"}
        if not isinstance(c, Mapping) or set(c) != names:
            raise ManifestError("a manifest names exactly its fields")
        if c["v"] != MANIFEST_VERSION:
            raise ManifestError(f"manifest version {c['v']!r}; this build reads {MANIFEST_VERSION}")
        rows = c["tensors"]
        if not isinstance(rows, list) or len(rows) > MAX_TENSORS:
            raise ManifestError(f"a manifest's tensors are a list of at most {MAX_TENSORS}")
        tensors = []
        for row in rows:
            if not isinstance(row, list) or len(row) != 6 or not isinstance(row[2], list):
                raise ManifestError("a manifest's tensor is [name, type, dims, offset, nbytes, sha256]")
            tensors.append(TensorEntry(row[0], row[1], tuple(row[2]), row[3], row[4], row[5]))
        return cls(c["source_sha256"], c["architecture"], c["n_layer"], c["file_name"], c["file_size"],
                   c["header_size"], c["header_sha256"], tuple(tensors))

    @classmethod
    def from_bytes(cls, data: bytes) -> "Manifest":
        if not isinstance(data, bytes) or len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"a manifest is at most {MAX_MANIFEST_BYTES} bytes")
        try:
            content = unpack_strict(data)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
            raise ManifestError(f"a manifest is not msgpack: {e}") from None
        m = cls.from_content(content)
        if m.to_bytes() != data:
            raise ManifestError("a manifest is not in canonical form")  # one manifest, one encoding
        return m


def _int(v: Any, what: str, lo: int, hi: int) -> None:
    if type(v) is not int or not lo <= v <= hi:
        raise ManifestError(f"a manifest's {what} is an integer in [{lo}, {hi}]")


def _check(m: Manifest) -> None:
    """Every field typed and bounded, and the whole consistent (see the module's doc)."""
    if not isinstance(m.source_sha256, str) or len(m.source_sha256) != 64 or \
            any(ch not in "0123456789abcdef" for ch in m.source_sha256):
        raise ManifestError("a manifest's source_sha256 is 64 lowercase hex digits")
    if not isinstance(m.architecture, str) or not 0 < len(m.architecture) <= MAX_ARCH:
        raise ManifestError(f"a manifest's architecture is a string of 1-{MAX_ARCH} characters")
    if not isinstance(m.file_name, str) or not 0 < len(m.file_name) <= MAX_FILE_NAME or \
            os.path.basename(m.file_name) != m.file_name or m.file_name in (".", "..") or "\0" in m.file_name:
        raise ManifestError("a manifest's file_name is a plain file name")
    _int(m.n_layer, "n_layer", 1, 1 << 16)
    _int(m.file_size, "file_size", 1, MAX_FILE_SIZE)
    _int(m.header_size, "header_size", 1, min(MAX_HEADER, m.file_size))
    if not isinstance(m.header_sha256, bytes) or len(m.header_sha256) != 32:
        raise ManifestError("a manifest's header_sha256 is 32 bytes")
    if not isinstance(m.tensors, tuple) or not 0 < len(m.tensors) <= MAX_TENSORS:
        raise ManifestError(f"a manifest lists 1-{MAX_TENSORS} tensors")
    seen: set[str] = set()
    end = 0
    for t in sorted(m.tensors, key=lambda t: t.offset if type(t.offset) is int else -1):
        if not isinstance(t, TensorEntry) or not isinstance(t.name, str) or not 0 < len(t.name) <= MAX_TENSOR_NAME:
            raise ManifestError(f"a manifest's tensor name is a string of 1-{MAX_TENSOR_NAME} characters")
        if t.name in seen:
            raise ManifestError(f"a manifest lists tensor {t.name!r} twice")
        seen.add(t.name)
        _int(t.ggml_type, "tensor type", 0, 1 << 16)
        if not 1 <= len(t.dims) <= GGML_MAX_DIMS:
            raise ManifestError(f"a manifest's tensor has 1-{GGML_MAX_DIMS} dims")
        for d in t.dims:
            _int(d, "tensor dim", 1, MAX_DIM)
        _int(t.offset, "tensor offset", 0, MAX_FILE_SIZE)
        _int(t.nbytes, "tensor length", 1, MAX_FILE_SIZE)
        try:
            expected = tensor_nbytes(t.ggml_type, t.dims)
        except (GGUFFormatError, ValueError, KeyError):
            raise ManifestError(f"tensor {t.name!r} has a type ggml does not know ({t.ggml_type})") from None
        if t.nbytes != expected:
            raise ManifestError(f"tensor {t.name!r} is {t.nbytes} bytes, its type and dims make {expected}")
        if t.offset < end:
            raise ManifestError(f"tensor {t.name!r} overlaps the tensor before it")
        end = t.offset + t.nbytes
        if not isinstance(t.sha256, bytes) or len(t.sha256) != 32:
            raise ManifestError("a manifest's tensor sha256 is 32 bytes")
    if m.header_size + end > m.file_size:
        raise ManifestError("a manifest's tensors run past the end of its file")


def build_manifest(path: str, progress: Progress | None = None) -> Manifest:
    """The manifest of a whole model file, in one pass over its bytes (the file's own
    sha256 included). Raises GGUFFormatError for a file that is not a model,
    ManifestError for one no manifest can describe (overlapping tensors)."""
    src = read_gguf(path)
    if any(k.startswith("meshnet.") for k in src.kv):
        raise ManifestError(f"{path} is a shard, not a model file: build the manifest from the whole model")
    arch = src.get("general.architecture")
    n_layer = src.get(f"{arch}.block_count") if isinstance(arch, str) else None
    if not isinstance(arch, str) or type(n_layer) is not int:
        raise GGUFFormatError(f"{path}: no general.architecture or block count")
    whole = hashlib.sha256()
    header = hashlib.sha256()
    sums: dict[str, bytes] = {}
    done = 0
    short = f"{path}: file ended while hashing it"

    with open(path, "rb") as f:
        def feed(lo: int, hi: int, h=None) -> None:
            nonlocal done
            for chunk in read_range(f, lo, hi - lo, short=short):
                whole.update(chunk)
                if h is not None:
                    h.update(chunk)
                done += len(chunk)
                if progress:
                    progress("manifest", done, src.file_size)

        feed(0, src.data_offset, header)
        pos = src.data_offset
        for t in sorted(src.tensors, key=lambda t: t.offset):
            lo = src.data_offset + t.offset
            if lo < pos:
                raise ManifestError(f"{path}: tensor {t.name!r} overlaps the one before it")
            feed(pos, lo)
            h = hashlib.sha256()
            feed(lo, lo + t.nbytes, h)
            sums[t.name] = h.digest()
            pos = lo + t.nbytes
        feed(pos, src.file_size)
    tensors = tuple(TensorEntry(t.name, t.ggml_type, t.dims, t.offset, t.nbytes, sums[t.name]) for t in src.tensors)
    return Manifest(whole.hexdigest(), arch, n_layer, os.path.basename(path), src.file_size, src.data_offset,
                    header.digest(), tensors)
