"""GGUF through gguf-py: its reader (bounded), its writer and its format tables.

The tables that move with every llama.cpp release (metadata value types, ggml
tensor types and their block sizes) come from the ``gguf`` package (gguf-py,
kept in llama.cpp's own repository, pinned beside llama-cpp-python).

Files are read by gguf-py's ``GGUFReader`` (:func:`read_gguf`), with a few of
its methods overridden (:class:`_Reader`): as released it reads past a file's
end (a truncated string is a bare IndexError, a 40-byte file declaring a
2**40-element array keeps it looping) and makes a numpy view per array
element (~13 s to open Gemma 3 270M). We keep every entry's byte span (a
shard's binding and a tokenizer's digest are over the file's own bytes).

Files are written with its ``GGUFWriter`` (:func:`write_gguf`): the format's
bytes are gguf-py's, only tensor data (opaque to the format) is copied by us,
in chunks. The format is documented in ggml's docs/gguf.md. Only GGUF v2 and
v3 little-endian files are read; v1 is long obsolete.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import struct
import tempfile
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


class _Reader(gguf.GGUFReader):
    """gguf-py's ``GGUFReader`` with every read bounded and arrays read in one piece.

    The format's parsing (header, the metadata loop, scalars, strings, the tensor
    table, alignment, duplicate keys and tensors) is gguf-py's. Overridden, and
    only these: ``_get`` refuses to read past the file (gguf-py slices past the
    end and fails later with a bare IndexError, or loops on a huge count: each
    item now costs at least a byte, so every loop ends within the file), the
    counts and lengths are bounded, and an array is parsed here, in one piece
    (gguf-py makes a view per element: ~13 s for Gemma 3's 262k-token
    vocabulary). A numeric array's field holds its values as one part, so
    ``contents()`` gives the whole list (not ``contents(i)`` per item); a string
    array's holds its bytes as one part, decoded here as they are read and kept
    in ``string_arrays`` (its ``contents()`` is not the strings). Tensor data is
    not mapped: the table is checked by :func:`_tensors`, and a header fetched
    alone has no data.
    """

    def __init__(self, source: Any, what: str) -> None:
        self._what = what
        self.string_arrays: dict[int, tuple[str, ...]] = {}  # id(a field's body part) -> its strings
        super().__init__(source)

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        count = int(count)
        end = offset + np.dtype(dtype).itemsize * count
        if count < 0 or end > len(self.data):
            raise GGUFFormatError(f"{self._what}: truncated (needed bytes up to {end}, have {len(self.data)})")
        return super()._get(offset, dtype, count, override_order)

    def _check_length(self, n: int, offset: int) -> None:
        if n > MAX_STRING:
            raise GGUFFormatError(f"{self._what}: string length {n} at offset {offset} exceeds the {MAX_STRING}-byte bound")

    def _get_str(self, offset: int) -> tuple[np.ndarray, np.ndarray]:
        n = self._get(offset, np.uint64)
        self._check_length(int(n[0]), offset)
        return n, self._get(offset + 8, np.uint8, n[0])

    def _build_fields(self, offs: int, count: int) -> int:
        if count > MAX_KV:
            raise GGUFFormatError(f"{self._what}: implausible count of {count} metadata keys")
        return super()._build_fields(offs, count)

    def _build_tensor_info(self, offs: int, count: int) -> tuple[int, list]:
        if count > MAX_TENSORS:
            raise GGUFFormatError(f"{self._what}: implausible count of {count} tensors")
        return super()._build_tensor_info(offs, count)

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        self.tensor_fields = fields

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list[int], list]:
        if raw_type != ValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        count = self._get(orig_offs + 4, np.uint64)
        n = int(count[0])
        if n > MAX_ARRAY:
            raise GGUFFormatError(f"{self._what}: array of {n} elements at offset {orig_offs} exceeds the bound")
        itype = ValueType(raw_itype[0])
        parts: list[np.ndarray] = [raw_itype, count]
        offs = orig_offs + 12
        if itype is ValueType.STRING:
            mv, size, strings = memoryview(self.data.view(np.ndarray)), len(self.data), []
            for _ in range(n):
                k = int.from_bytes(mv[offs : offs + 8], "little") if offs + 8 <= size else -1
                self._check_length(k, offs)
                if k < 0 or offs + 8 + k > size:
                    raise GGUFFormatError(f"{self._what}: truncated (a string at offset {offs} runs past {size})")
                strings.append(str(mv[offs + 8 : offs + 8 + k], "utf-8"))
                offs += 8 + k
            body = self._get(orig_offs + 12, np.uint8, offs - orig_offs - 12)
            self.string_arrays[id(body)] = tuple(strings)
            return offs - orig_offs, [*parts, body], [2], [ValueType.ARRAY, itype]
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is None:
            raise GGUFFormatError(f"{self._what}: nested arrays are not supported")
        values = self._get(offs, nptype, n)
        parts.append(values)
        return 12 + int(values.nbytes), parts, [2], [ValueType.ARRAY, itype]


def read_gguf(path: str | os.PathLike[str], *, buf: bytes | None = None, file_size: int | None = None) -> GGUFFile:
    """Parse a GGUF file's header, metadata and tensor table (gguf-py's reader,
    bounded), with every entry's byte span and every tensor checked to lie inside
    the file; tensor data is not read.

    ``buf`` lets tests and fuzzers parse bytes, and a fetcher a header on its own
    (``file_size``: the size of the whole file it heads; default ``len(buf)``):
    gguf-py maps a file, so the bytes go to an anonymous temporary file first.
    """
    path = os.fspath(path)
    what = os.path.basename(path) or "gguf"
    try:
        # (first, so that any other file is called what it is, not a malformed GGUF)
        if (buf[:4] if buf is not None else _head(path)) != GGUF_MAGIC:
            raise GGUFFormatError(f"{what}: not a GGUF file (bad magic)")
        if buf is not None:
            with tempfile.TemporaryFile() as tmp:
                tmp.write(buf)
                tmp.flush()
                # (numpy's memmap, which GGUFReader opens, takes an open file as well as a name)
                reader = _Reader(tmp, what)
                return _gguf_file(reader, path, what, len(buf) if file_size is None else file_size)
        size = os.path.getsize(path)
        return _gguf_file(_Reader(path, what), path, what, size)
    except GGUFFormatError:
        raise
    except KeyError as e:  # gguf-py's word for a duplicate key
        raise GGUFFormatError(f"{what}: {e.args[0] if e.args else e}") from None
    except (ValueError, OverflowError) as e:  # gguf-py's word for a bad magic, version, type, UTF-8, alignment
        raise GGUFFormatError(f"{what}: not a well-formed GGUF file: {e}") from None
    except OSError as e:
        raise GGUFFormatError(f"{path}: cannot read: {e.strerror or e}") from None


def _head(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read(4)


def _gguf_file(reader: _Reader, path: str, what: str, size: int) -> GGUFFile:
    if reader.byte_order != "I":
        raise GGUFFormatError(f"{what}: a big-endian GGUF file (only little-endian files are read)")
    kv: dict[str, KVEntry] = {}
    for key, field in itertools.islice(reader.fields.items(), 3, None):  # (after gguf-py's fields for the version and counts)
        vtype = field.types[0]
        array_type = field.types[1] if vtype is ValueType.ARRAY else None
        if array_type is ValueType.STRING:
            value: Any = reader.string_arrays[id(field.parts[field.data[0]])]
        elif array_type is not None:
            value = tuple(field.contents())
        else:
            value = field.contents()
        end = field.offset + sum(int(p.nbytes) for p in field.parts)
        kv[key] = KVEntry(key, vtype, (field.offset, end), value, array_type)
    alignment = int(reader.alignment)
    tensors = _tensors(reader.tensor_fields, what)
    data_offset = int(reader.data_offset)
    for t in tensors:
        if t.offset % alignment:
            raise GGUFFormatError(f"{what}: tensor {t.name!r} data is not aligned")
        if data_offset + t.offset + t.nbytes > size:
            raise GGUFFormatError(
                f"{what}: truncated: tensor {t.name!r} needs bytes up to {data_offset + t.offset + t.nbytes}, file has {size}"
            )
    return GGUFFile(path, int(reader.fields["GGUF.version"].parts[0][0]), kv, tuple(kv), tensors, alignment, data_offset, size)


def _tensors(fields: list, what: str) -> tuple[TensorInfo, ...]:
    """The tensor table gguf-py parsed, checked (what its ``_build_tensors`` would
    check, and the dimensions, types and sizes ggml accepts)."""
    out: list[TensorInfo] = []
    names: set[str] = set()
    for field in fields:
        _, _, n_dims, dims, gtype, offset = field.parts
        name = field.name
        if not 1 <= int(n_dims[0]) <= GGML_MAX_DIMS:
            raise GGUFFormatError(f"{what}: tensor {name!r} has {int(n_dims[0])} dimensions")
        shape = tuple(int(d) for d in dims)
        if any(d <= 0 or d > (1 << 40) for d in shape):
            raise GGUFFormatError(f"{what}: tensor {name!r} has bad dimensions {shape}")
        if name in names:
            raise GGUFFormatError(f"{what}: duplicate tensor {name!r}")
        names.add(name)
        out.append(TensorInfo(name, shape, int(gtype[0]), int(offset[0]), tensor_nbytes(int(gtype[0]), shape)))
    return tuple(out)


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
