"""GGUF: a small, strict reader of our own; gguf-py's writer and format tables.

The tables that move with every llama.cpp release (metadata value types, ggml
tensor types and their block sizes) come from the ``gguf`` package (gguf-py,
kept in llama.cpp's own repository, pinned beside llama-cpp-python), and files
are written with its ``GGUFWriter`` (:func:`write_gguf`): the format's bytes
are gguf-py's, only tensor data (opaque to the format) is copied by us, in
chunks.

Reading stays ours: gguf-py's ``GGUFReader`` bounds nothing (a 40-byte file
declaring a 2**40-element array keeps it looping; a truncated string raises a
bare IndexError), takes a path only (no bytes for the fuzzers), and builds a
numpy view per array element: 3.0 s against our 0.17 s on the embedded 135M
model, 11.9 s against 0.35 s on Gemma 3 270M's 262k-token vocabulary, paid by
every process that opens a shard. We need the byte span of every metadata
entry (a shard's binding and a tokenizer's digest are over the file's own
bytes) and hard bounds on every count and length (a truncated or hostile file
must give a typed error, never a huge allocation or an endless loop). The
format is documented in ggml's docs/gguf.md.

Only GGUF v2 and v3 little-endian files are read; v1 is long obsolete.
"""

from __future__ import annotations

import contextlib
import os
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Iterable, Iterator, Mapping, Sequence

import gguf
import numpy as np

from meshnet_p2p.core.errors import MeshnetError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = gguf.GGUF_DEFAULT_ALIGNMENT
GGML_MAX_DIMS = 4

# Bounds. Generous for real models, small enough that a corrupt count fails fast.
MAX_KV = 1 << 16
MAX_TENSORS = 1 << 20
MAX_STRING = 1 << 24  # chat templates are ~10 KB; 16 MiB is far beyond any real key
MAX_ARRAY = 1 << 26


class GGUFFormatError(MeshnetError):
    """The file is not a well-formed GGUF file (bad magic, truncated, corrupt)."""


# The metadata value types (UINT8 = 0 ... FLOAT64 = 12), as gguf-py names them.
ValueType = gguf.GGUFValueType

_SCALAR_FMT = {
    ValueType.UINT8: "<B",
    ValueType.INT8: "<b",
    ValueType.UINT16: "<H",
    ValueType.INT16: "<h",
    ValueType.UINT32: "<I",
    ValueType.INT32: "<i",
    ValueType.FLOAT32: "<f",
    ValueType.BOOL: "<?",
    ValueType.UINT64: "<Q",
    ValueType.INT64: "<q",
    ValueType.FLOAT64: "<d",
}

# ggml tensor type id -> (elements per block, bytes per block), from gguf-py. Types
# it does not list (removed ones, and any newer than the pinned release) are refused,
# and so is Q8_1: gguf-py keeps its old 40-byte block where ggml's is 36 bytes (ggml
# uses it for activations only, no model file holds it), so refused, not mis-sized.
# tests/test_gguf_cut.py checks every size against the ggml that llama-cpp-python links.
GGML_BLOCKS: Mapping[int, tuple[int, int]] = {
    int(t): size for t, size in gguf.GGML_QUANT_SIZES.items() if t is not gguf.GGMLQuantizationType.Q8_1
}


def tensor_nbytes(ggml_type: int, dims: Sequence[int]) -> int:
    """Bytes of a tensor's data; dims are GGUF order (ne0 first)."""
    try:
        block, size = GGML_BLOCKS[ggml_type]
    except KeyError:
        raise GGUFFormatError(f"unsupported ggml tensor type id {ggml_type}") from None
    n = 1
    for d in dims:
        n *= d
    if not dims or dims[0] % block:
        raise GGUFFormatError(f"tensor row of {dims[0] if dims else 0} elements is not a whole number of {block}-element blocks")
    return n // block * size


@dataclass(frozen=True)
class KVEntry:
    key: str
    type: ValueType
    span: tuple[int, int]  # byte range of the whole entry (key, type, value) in the file
    value: Any  # decoded; arrays of numbers are tuples, arrays of strings tuples of str
    array_type: ValueType | None = None


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: ne0 (row length) first
    ggml_type: int
    offset: int  # relative to the data section
    nbytes: int


@dataclass(frozen=True)
class GGUFFile:
    path: str
    version: int
    kv: Mapping[str, KVEntry]
    kv_order: tuple[str, ...]
    tensors: tuple[TensorInfo, ...]
    alignment: int
    data_offset: int
    file_size: int

    def get(self, key: str, default: Any = None) -> Any:
        entry = self.kv.get(key)
        return default if entry is None else entry.value

    def tensor(self, name: str) -> TensorInfo | None:
        for t in self.tensors:
            if t.name == name:
                return t
        return None

    def raw_entry(self, key: str) -> bytes:
        start, end = self.kv[key].span
        with open(self.path, "rb") as f:
            f.seek(start)
            return f.read(end - start)


class _Short(Exception):
    """The parse ran past the bytes read so far (maybe only past the window)."""


class _Cursor:
    """Bounds-checked reads over a bytes-like buffer."""

    def __init__(self, buf: memoryview, what: str) -> None:
        self.buf = buf
        self.pos = 0
        self.what = what

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise _Short(f"{self.what}: truncated (needed {n} bytes at offset {self.pos}, have {len(self.buf)})")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, self.take(size))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > MAX_STRING:
            raise GGUFFormatError(f"{self.what}: string length {n} at offset {self.pos} exceeds the {MAX_STRING}-byte bound")
        raw = self.take(n)
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFFormatError(f"{self.what}: string at offset {self.pos - n} is not UTF-8") from None

    def value(self, vtype: int) -> tuple[Any, ValueType | None]:
        try:
            t = ValueType(vtype)
        except ValueError:
            raise GGUFFormatError(f"{self.what}: unknown metadata value type {vtype}") from None
        if t is ValueType.STRING:
            return self.string(), None
        if t is ValueType.ARRAY:
            sub = self.unpack("<I")
            count = self.unpack("<Q")
            if count > MAX_ARRAY:
                raise GGUFFormatError(f"{self.what}: array of {count} elements exceeds the bound")
            try:
                st = ValueType(sub)
            except ValueError:
                raise GGUFFormatError(f"{self.what}: unknown array element type {sub}") from None
            if st is ValueType.ARRAY:
                raise GGUFFormatError(f"{self.what}: nested arrays are not supported")
            if st is ValueType.STRING:
                return tuple(self.string() for _ in range(count)), st
            fmt = _SCALAR_FMT[st]
            size = struct.calcsize(fmt)
            raw = self.take(size * count)
            return tuple(struct.unpack(f"<{count}{fmt[1]}", raw)), st
        return self.unpack(_SCALAR_FMT[t]), None


def read_gguf(path: str | os.PathLike[str], *, buf: bytes | None = None, file_size: int | None = None) -> GGUFFile:
    """Parse a GGUF file's header, metadata and tensor table, with every bound checked.

    Tensor data is not read, only checked to lie inside the file. ``buf`` lets
    tests and fuzzers parse bytes directly, and a fetcher a header on its own
    (``file_size``: the size of the whole file it heads; default ``len(buf)``).
    """
    path = os.fspath(path)
    what = os.path.basename(path) or "gguf"
    if buf is not None:
        try:
            return _parse(memoryview(buf), len(buf) if file_size is None else file_size, path, what)
        except _Short as e:
            raise GGUFFormatError(str(e)) from None
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            # The header has no length field: parse a window and grow it while
            # the parse runs off its end. Real headers are a few MB (vocabularies).
            window = min(size, 8 << 20)
            while True:
                f.seek(0)
                data = f.read(window)
                try:
                    return _parse(memoryview(data), size, path, what)
                except _Short as e:
                    if window >= size:
                        raise GGUFFormatError(str(e)) from None
                    window = min(size, window * 4)
    except OSError as e:
        raise GGUFFormatError(f"{path}: cannot read: {e.strerror or e}") from None


def _parse(data: memoryview, size: int, path: str, what: str) -> GGUFFile:
    cur = _Cursor(data, what)
    if len(data) < 4 or bytes(data[:4]) != GGUF_MAGIC:
        raise GGUFFormatError(f"{what}: not a GGUF file (bad magic)")
    cur.take(4)
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise GGUFFormatError(f"{what}: unsupported GGUF version {version} (need 2 or 3)")
    n_tensors = cur.unpack("<Q")
    n_kv = cur.unpack("<Q")
    if n_tensors > MAX_TENSORS or n_kv > MAX_KV:
        raise GGUFFormatError(f"{what}: implausible counts ({n_tensors} tensors, {n_kv} metadata keys)")
    kv: dict[str, KVEntry] = {}
    order: list[str] = []
    for _ in range(n_kv):
        start = cur.pos
        key = cur.string()
        vtype = cur.unpack("<I")
        value, sub = cur.value(vtype)
        if key in kv:
            raise GGUFFormatError(f"{what}: duplicate metadata key {key!r}")
        kv[key] = KVEntry(key, ValueType(vtype), (start, cur.pos), value, sub)
        order.append(key)
    tensors: list[TensorInfo] = []
    names: set[str] = set()
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("<I")
        if not 1 <= n_dims <= GGML_MAX_DIMS:
            raise GGUFFormatError(f"{what}: tensor {name!r} has {n_dims} dimensions")
        dims = tuple(cur.unpack("<Q") for _ in range(n_dims))
        if any(d <= 0 or d > (1 << 40) for d in dims):
            raise GGUFFormatError(f"{what}: tensor {name!r} has bad dimensions {dims}")
        gtype = cur.unpack("<I")
        offset = cur.unpack("<Q")
        if name in names:
            raise GGUFFormatError(f"{what}: duplicate tensor {name!r}")
        names.add(name)
        tensors.append(TensorInfo(name, dims, gtype, offset, tensor_nbytes(gtype, dims)))
    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in kv:
        alignment = kv["general.alignment"].value
        if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"{what}: general.alignment {alignment!r} is not a power of two")
    data_offset = align_up(cur.pos, alignment)
    for t in tensors:
        if t.offset % alignment:
            raise GGUFFormatError(f"{what}: tensor {t.name!r} data is not aligned")
        if data_offset + t.offset + t.nbytes > size:
            raise GGUFFormatError(
                f"{what}: truncated: tensor {t.name!r} needs bytes up to {data_offset + t.offset + t.nbytes}, file has {size}"
            )
    return GGUFFile(path, version, kv, tuple(order), tuple(tensors), alignment, data_offset, size)


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


# --- writing -----------------------------------------------------------------


def encode_string(s: str) -> bytes:
    """A GGUF string's encoding (length, UTF-8 bytes): what the digests over metadata
    hash their domain tags as."""
    raw = s.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


@dataclass(frozen=True)
class KV:
    """A metadata entry to write (gguf-py encodes it); a :class:`KVEntry` read from a
    file is written as it is."""

    key: str
    type: ValueType
    value: Any
    array_type: ValueType | None = None


@dataclass(frozen=True)
class OutTensor:
    """A tensor of the file being written: bytes come from ``source_offset`` of the
    source file, or from ``data`` when the tensor is synthesised (a dummy)."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    nbytes: int
    source_offset: int | None = None
    data: bytes | None = None


CHUNK = 4 << 20


def read_range(f: BinaryIO, offset: int, length: int, *, short: str) -> Iterator[bytes]:
    """``length`` bytes of ``f`` from ``offset``, CHUNK at a time; GGUFFormatError(``short``)
    if the file ends first (truncated while we read it)."""
    f.seek(offset)
    while length:
        chunk = f.read(min(CHUNK, length))
        if not chunk:
            raise GGUFFormatError(short)
        length -= len(chunk)
        yield chunk


@contextlib.contextmanager
def written_atomically(out_path: str, tag: str):
    """A private temporary name beside ``out_path``, renamed into place when the
    block succeeds and removed when it fails, so ``out_path`` only ever holds a
    whole file. A name of our own: two processes writing the same file at once
    never write into one; whichever renames last wins, both files being whole."""
    tmp = f"{out_path}.{os.getpid()}.{os.urandom(4).hex()}.{tag}"
    try:
        yield tmp
        os.replace(tmp, out_path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_gguf(
    out_path: str,
    kv_entries: Iterable[KV | KVEntry],
    tensors: Sequence[OutTensor],
    *,
    source_path: str | None,
    alignment: int = DEFAULT_ALIGNMENT,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Write a GGUF v3 file with gguf-py's ``GGUFWriter``: it encodes the header, the
    metadata and the tensor table; tensor bytes (opaque to the format) are copied
    from the source file 4 MiB at a time, so no tensor is held whole in memory.

    gguf-py writes ``general.architecture`` first whatever its place in
    ``kv_entries``; a key given twice, and what gguf-py cannot encode (an empty
    array, a value that does not fit its type), are a GGUFFormatError here.
    The file is written under a temporary name and renamed into place, so a
    crash never leaves a truncated shard where a valid one is expected.
    """
    kv_list = list(kv_entries)
    if len({e.key for e in kv_list}) != len(kv_list):
        # (gguf-py would keep the last value of a key written twice, and say so only in a log)
        raise GGUFFormatError(f"{out_path}: a metadata key is written twice")
    arch = next((e.value for e in kv_list if e.key == gguf.Keys.General.ARCHITECTURE), None)
    if not isinstance(arch, str) or not arch:
        raise GGUFFormatError(f"{out_path}: a GGUF file needs a general.architecture string")
    total = sum(align_up(t.nbytes, alignment) for t in tensors)
    done = 0
    # (the writer's file is closed before the name is renamed into place or removed)
    with written_atomically(out_path, "partial") as tmp, contextlib.closing(gguf.GGUFWriter(tmp, arch)) as writer:
        writer.data_alignment = alignment  # (GGUFWriter wrote general.architecture itself)
        try:
            for e in kv_list:
                if e.key != gguf.Keys.General.ARCHITECTURE:
                    writer.add_key_value(e.key, e.value, e.type, e.array_type)
            for t in tensors:
                # gguf-py takes numpy's order (ne0 last) and, for raw bytes, the
                # byte shape, as its own copying scripts pass a tensor it read.
                qtype = gguf.GGMLQuantizationType(t.ggml_type)
                shape = gguf.quant_shape_to_byte_shape(tuple(reversed(t.dims)), qtype)
                writer.add_tensor_info(t.name, shape, np.dtype(np.uint8), t.nbytes, raw_dtype=qtype)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
        except (ValueError, TypeError, OverflowError, struct.error) as e:
            raise GGUFFormatError(f"{out_path}: gguf-py cannot write it: {e}") from None
        out = writer.fout[0]
        writer.write_padding(out, out.tell())  # the data section starts aligned
        with open(source_path, "rb") if source_path else contextlib.nullcontext() as src:
            for t in tensors:
                if t.data is not None:
                    out.write(t.data)
                    done += len(t.data)
                else:
                    if src is None:
                        raise GGUFFormatError(f"no source file to copy {t.name!r} from")
                    for chunk in read_range(src, t.source_offset, t.nbytes, short=f"source ended while copying {t.name!r}"):
                        out.write(chunk)
                        done += len(chunk)
                        if progress:
                            progress(done, total)
                writer.write_padding(out, t.nbytes)
        out.flush()
        os.fsync(out.fileno())
    if progress:
        progress(total, total)
