"""GGUF parsing (strict, bounded, fuzzed) and cutting shards."""

import ctypes
import json
import os
import struct

import gguf

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshnet_p2p.engine.adapters import UncarriedLayerProperty, UnsupportedArchitecture
from meshnet_p2p.engine.contract import LoadRequest, StatusCode
from meshnet_p2p.engine.cut import (
    LayerRangeError,
    ShardCutError,
    cut_shard,
    inspect_gguf,
    parse_layer_range,
    sha256_file,
)
from meshnet_p2p.engine.gguf import (
    GGML_BLOCKS,
    GGUFFormatError,
    OutTensor,
    ValueType,
    KV,
    read_gguf,
    tensor_nbytes,
    write_gguf,
)
from meshnet_p2p.engine.llama_native import ggml_base
from meshnet_p2p.engine.llama_engine import LlamaCppShardEngine

from tests.swarm import meshnet_peer


def tiny_gguf(path, arch="llama", n_layer=2, n_embd=32, extra_kv=()):
    kv = [
        KV("general.architecture", ValueType.STRING, arch),
        KV(f"{arch}.block_count", ValueType.UINT32, n_layer),
        KV(f"{arch}.embedding_length", ValueType.UINT32, n_embd),
        KV(f"{arch}.feed_forward_length", ValueType.ARRAY, list(range(100, 100 + n_layer)), ValueType.UINT32),
        *extra_kv,
    ]
    row = struct.pack(f"<{n_embd}f", *range(n_embd))
    tensors = [OutTensor("token_embd.weight", (n_embd, 1), 0, len(row), data=row)]
    tensors.append(OutTensor("output_norm.weight", (n_embd,), 0, len(row), data=row))
    for i in range(n_layer):
        tensors.append(OutTensor(f"blk.{i}.attn_norm.weight", (n_embd,), 0, len(row), data=row))
    write_gguf(str(path), kv, tensors, source_path=None)
    return str(path)


def test_writer_and_reader_round_trip(tmp_path):
    path = tiny_gguf(tmp_path / "m.gguf", n_layer=3)
    f = read_gguf(path)
    assert f.get("general.architecture") == "llama"
    assert f.get("llama.feed_forward_length") == (100, 101, 102)
    assert [t.name for t in f.tensors][-1] == "blk.2.attn_norm.weight"
    assert f.file_size == os.path.getsize(path)


# sha256 of the embedded model's shards as the writer of our own wrote them before
# files were written by gguf-py's GGUFWriter: a shard's bytes are its identity (its
# binding, the fingerprints certified over it), so moving the writer must not move them.
SHARD_SHA256 = {
    (0, 10): "8fb48737b222fd0477eb68d1d588ad71e73ec65cb1e8337c923ca4e90557de82",
    (10, 20): "3f6dacbc98220a0160fe6ef2001cd8e997401a1e3bbe6697e95ea90187dc32ff",
    (20, 30): "b4205c211ef46358c9b8b2fa343c72f56e465d0a6e92d460cc7127d4333bc699",
}


@pytest.mark.parametrize("span", SHARD_SHA256)
def test_shards_are_the_bytes_they_always_were(shard_dir, span):
    assert sha256_file(shard_dir[span]) == SHARD_SHA256[span]


# Every metadata value type, and arrays of each: what a model file may carry.
_SCALARS = {
    ValueType.UINT8: st.integers(0, 2**8 - 1),
    ValueType.INT8: st.integers(-(2**7), 2**7 - 1),
    ValueType.UINT16: st.integers(0, 2**16 - 1),
    ValueType.INT16: st.integers(-(2**15), 2**15 - 1),
    ValueType.UINT32: st.integers(0, 2**32 - 1),
    ValueType.INT32: st.integers(-(2**31), 2**31 - 1),
    ValueType.UINT64: st.integers(0, 2**64 - 1),
    ValueType.INT64: st.integers(-(2**63), 2**63 - 1),
    ValueType.FLOAT32: st.floats(width=32, allow_nan=False),
    ValueType.FLOAT64: st.floats(allow_nan=False),
    ValueType.BOOL: st.booleans(),
    ValueType.STRING: st.text(max_size=20),
}


@st.composite
def _kv_entry(draw, key):
    vtype = draw(st.sampled_from([*_SCALARS, ValueType.ARRAY]))
    if vtype is not ValueType.ARRAY:
        return KV(key, vtype, draw(_SCALARS[vtype]))
    sub = draw(st.sampled_from(list(_SCALARS)))
    return KV(key, vtype, tuple(draw(st.lists(_SCALARS[sub], min_size=1, max_size=8))), sub)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_what_is_written_reads_back_the_same_in_both_readers(tmp_path, data):
    """Files are written by gguf-py; read_gguf (gguf-py's reader, bounded, arrays read
    whole) and gguf-py's reader as released read back every entry and tensor as written."""
    keys = data.draw(st.lists(st.text("abcdefgh._", min_size=1, max_size=12), max_size=6, unique=True))
    extra = [data.draw(_kv_entry(f"x.{k}")) for k in keys]
    path = tiny_gguf(tmp_path / f"m{len(os.listdir(tmp_path))}.gguf", n_layer=2, extra_kv=extra)
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    for e in extra:
        got = ours.kv[e.key]
        assert (got.type, got.value, got.array_type) == (e.type, e.value, e.array_type)
        field = theirs.fields[e.key]
        assert field.types[0] == e.type
        assert (tuple(field.contents()) if e.array_type is not None else field.contents()) == e.value
        start, end = got.span
        assert field.offset == start and field.offset + sum(p.nbytes for p in field.parts) == end
    assert [(t.name, t.dims, t.offset) for t in ours.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), t.data_offset - theirs.data_offset) for t in theirs.tensors
    ]
    assert all(bytes(t.data) == struct.pack("<32f", *range(32)) for t in theirs.tensors if t.name != "token_embd.weight")


@pytest.mark.parametrize("extra,why", [
    ([KV("x.empty", ValueType.ARRAY, (), ValueType.UINT32)], "gguf-py cannot write"),
    ([KV("x.big", ValueType.UINT8, 256)], "gguf-py cannot write"),
    ([KV("x.twice", ValueType.UINT8, 1), KV("x.twice", ValueType.UINT8, 2)], "written twice"),
])
def test_what_cannot_be_written_as_given_is_a_typed_error_and_leaves_no_file(tmp_path, extra, why):
    with pytest.raises(GGUFFormatError, match=why):
        tiny_gguf(tmp_path / "m.gguf", extra_kv=extra)
    assert os.listdir(tmp_path) == []


def test_real_model_metadata_is_copied_byte_for_byte(shard_dir, model_path):
    src, head = read_gguf(model_path), read_gguf(shard_dir[(0, 10)])
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "llama.rope.freq_base"):
        assert head.raw_entry(key) == src.raw_entry(key)
    assert head.get("llama.block_count") == 10


def test_block_sizes_agree_with_the_linked_ggml():
    """The tensor sizes come from gguf-py; the ggml that llama-cpp-python links is what
    reads the shard, so every size we accept must be its size too."""
    ggml = ggml_base()
    ggml.ggml_blck_size.restype, ggml.ggml_blck_size.argtypes = ctypes.c_int64, [ctypes.c_int]
    ggml.ggml_type_size.restype, ggml.ggml_type_size.argtypes = ctypes.c_size_t, [ctypes.c_int]
    assert GGML_BLOCKS[0] == (1, 4) and GGML_BLOCKS[12] == (256, 144)  # F32, Q4_K
    for ggml_type, (block, size) in GGML_BLOCKS.items():
        assert (ggml.ggml_blck_size(ggml_type), ggml.ggml_type_size(ggml_type)) == (block, size), ggml_type
    # the one type gguf-py sizes differently from ggml is refused, not mis-sized
    q8_1 = gguf.GGMLQuantizationType.Q8_1
    assert gguf.GGML_QUANT_SIZES[q8_1] != (ggml.ggml_blck_size(q8_1), ggml.ggml_type_size(q8_1))
    with pytest.raises(GGUFFormatError, match="unsupported ggml tensor type id 9"):
        tensor_nbytes(q8_1, (32,))


def test_a_real_model_reads_as_gguf_py_reads_it(model_path, shard_dir):
    """read_gguf is gguf-py's reader, bounded and with arrays read whole: on the real
    model and a head shard it gives what gguf-py's reader as released gives."""
    for path in (model_path, shard_dir[(0, 10)]):
        ours, theirs = read_gguf(path), gguf.GGUFReader(path)
        assert list(ours.kv) == [k for k in theirs.fields if not k.startswith("GGUF.")]
        for key, e in ours.kv.items():
            field = theirs.fields[key]
            assert (e.type, e.array_type) == (field.types[0], field.types[1] if len(field.types) > 1 else None)
            assert e.value == (tuple(field.contents()) if e.array_type is not None else field.contents()), key
            assert e.span == (field.offset, field.offset + sum(int(p.nbytes) for p in field.parts))
        assert [(t.name, t.dims, t.ggml_type, t.offset, t.nbytes) for t in ours.tensors] == [
            (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), t.data_offset - theirs.data_offset, t.n_bytes)
            for t in theirs.tensors
        ]
        assert (ours.alignment, ours.data_offset) == (theirs.alignment, theirs.data_offset)


def test_reading_is_gguf_py_s(tmp_path, monkeypatch):
    """A change in gguf-py's reader changes what read_gguf gives (it is on the path)."""
    path = tiny_gguf(tmp_path / "m.gguf")
    parse = gguf.GGUFReader._get_tensor_info_field

    def renamed(self, offs):
        field = parse(self, offs)
        return field._replace(name="seen." + field.name)

    monkeypatch.setattr(gguf.GGUFReader, "_get_tensor_info_field", renamed)
    assert all(t.name.startswith("seen.") for t in read_gguf(path).tensors)


def _header(n_kv: int, *entries: bytes, n_tensors: int = 0, version: bytes = struct.pack("<I", 3)) -> bytes:
    return b"GGUF" + version + struct.pack("<QQ", n_tensors, n_kv) + b"".join(entries)


def _key(name: str, vtype: int) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode() + struct.pack("<I", vtype)


@pytest.mark.parametrize("data,why", [
    # what gguf-py's reader as released loops on, reads past the end or maps whole
    (_header(1, _key("a", 9), struct.pack("<IQ", 0, 2**40)), "exceeds the bound"),  # 2**40 uint8s in a 40-byte file
    (_header(1, _key("a", 9), struct.pack("<IQ", 0, 2**25)), "truncated"),  # fewer, still past the end
    (_header(1, _key("a", 9), struct.pack("<IQ", 8, 2**40)), "exceeds the bound"),  # 2**40 strings
    (_header(1, _key("a", 9), struct.pack("<IQ", 8, 3), struct.pack("<Q", 5), b"ab"), "truncated"),
    (_header(1, _key("a", 8), struct.pack("<Q", 2**62)), "exceeds the"),  # a 4 EiB string
    (_header(1, _key("a", 8), struct.pack("<Q", 9), b"abc"), "truncated"),  # a bare IndexError in gguf-py
    (_header(2**63), "implausible"),
    (_header(0, n_tensors=2**40), "implausible"),
    (_header(1, _key("a", 9), struct.pack("<IQ", 9, 1), struct.pack("<IQ", 0, 0)), "nested arrays"),
    (_header(1, _key("a", 42), b"\0" * 8), "not a well-formed GGUF file"),  # an unknown value type
    (_header(1, struct.pack("<Q", 2) + b"\xff\xfe" + struct.pack("<IB", 0, 1)), "not a well-formed GGUF file"),  # not UTF-8
    (_header(2, _key("a", 0), b"\1", _key("a", 0), b"\2"), "Duplicate a"),
    (_header(0, version=struct.pack(">I", 3)), "big-endian"),
    (_header(0, version=struct.pack("<I", 1)), "not a well-formed GGUF file"),
], ids=lambda v: v if isinstance(v, str) else f"{len(v)}B")
def test_hostile_headers_are_typed_errors_within_the_file(data, why):
    """Each ends within the file's bytes (every read is bounded by it), typed."""
    with pytest.raises(GGUFFormatError, match=why):
        read_gguf("x.gguf", buf=data)


@pytest.mark.parametrize("data", [b"", b"GGU", b"NOPE" + b"\0" * 100, b"GGUF" + struct.pack("<I", 7) + b"\0" * 16])
def test_not_a_gguf_is_a_typed_error(tmp_path, data):
    p = tmp_path / "x.gguf"
    p.write_bytes(data)
    with pytest.raises(GGUFFormatError):
        read_gguf(p)


def test_truncated_model_is_refused_everywhere(tmp_path, model_path):
    truncated = tmp_path / "truncated.gguf"
    with open(model_path, "rb") as src, open(truncated, "wb") as out:
        out.write(src.read(os.path.getsize(model_path) // 2))
    with pytest.raises(GGUFFormatError, match="truncated"):
        read_gguf(truncated)
    with pytest.raises(GGUFFormatError):
        cut_shard(str(truncated), 0, 10, str(tmp_path / "out.gguf"))
    engine = LlamaCppShardEngine()
    result = engine.load(LoadRequest(str(truncated)))
    assert result.status.code is StatusCode.LOAD_FAILED and "truncated" in result.status.message
    assert not engine.health().serving
    header_only = tmp_path / "header.gguf"
    with open(model_path, "rb") as src, open(header_only, "wb") as out:
        out.write(src.read(1000))
    with pytest.raises(GGUFFormatError, match="truncated"):
        read_gguf(header_only)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=512))
def test_fuzz_random_bytes_only_raise_format_errors(data):
    try:
        read_gguf("fuzz", buf=b"GGUF" + data)
    except GGUFFormatError:
        pass


@pytest.fixture(scope="module")
def small_header(tmp_path_factory):
    path = tiny_gguf(tmp_path_factory.mktemp("fuzz") / "m.gguf")
    return open(path, "rb").read()


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_fuzz_mutated_headers_only_raise_format_errors(small_header, data):
    buf = bytearray(small_header)
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(buf) - 1))
        buf[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(buf)))
    try:
        read_gguf("fuzz", buf=bytes(buf[:cut]))
    except GGUFFormatError:
        pass


def test_shards_are_bound_to_their_source(shard_dir, model_digest):
    roles = {}
    for (start, end), path in shard_dir.items():
        info = inspect_gguf(path)
        assert (info.start, info.end, info.source_layers) == (start, end, 30)
        assert info.source_sha256 == model_digest
        roles[(start, end)] = info.role
        f = read_gguf(path)
        assert f.get("meshnet.source.sha256") == model_digest
        assert f.get("llama.block_count") == end - start
        blocks = {t.name.split(".")[1] for t in f.tensors if t.name.startswith("blk.")}
        assert blocks == {str(i) for i in range(end - start)}
    assert roles[(0, 10)] == "head" and roles[(10, 20)] == "middle" and roles[(20, 30)] == "tail"


def test_middle_shard_is_slim_and_has_no_vocabulary(shard_dir):
    middle = read_gguf(shard_dir[(10, 20)])
    assert middle.get("tokenizer.ggml.model") == "none"
    assert "tokenizer.ggml.tokens" not in middle.kv
    assert middle.tensor("token_embd.weight").dims == (576, 1)
    head = read_gguf(shard_dir[(0, 10)])
    assert head.tensor("token_embd.weight").dims == (576, 49152)
    assert os.path.getsize(shard_dir[(10, 20)]) < os.path.getsize(shard_dir[(0, 10)]) / 2


def test_per_layer_metadata_arrays_follow_their_layers(tmp_path):
    src = tiny_gguf(tmp_path / "m.gguf", n_layer=4)
    cut_shard(src, 1, 3, str(tmp_path / "s.gguf"))
    assert read_gguf(tmp_path / "s.gguf").get("llama.feed_forward_length") == (101, 102)


@pytest.mark.parametrize("start,end", [(0, 31), (25, 40), (30, 31)])
def test_range_outside_the_model_is_refused(tmp_path, model_path, model_digest, start, end):
    with pytest.raises(LayerRangeError, match="outside the model"):
        cut_shard(model_path, start, end, str(tmp_path / "x.gguf"), source_sha256=model_digest)
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("text", ["10", "a:b", "5:5", "9:3", "1:2:3", ""])
def test_bad_range_text_is_refused(text):
    with pytest.raises(LayerRangeError):
        parse_layer_range(text)


@pytest.mark.parametrize("arch", ["gemma2", "granite", "bert"])
def test_unsupported_architecture_is_refused_by_name(tmp_path, arch):
    src = tiny_gguf(tmp_path / "m.gguf", arch=arch)
    with pytest.raises(UnsupportedArchitecture, match=repr(arch)):
        cut_shard(src, 0, 1, str(tmp_path / "s.gguf"))
    engine = LlamaCppShardEngine()
    result = engine.load(LoadRequest(src))
    assert result.status.code is StatusCode.LOAD_FAILED and arch in result.status.message


def _gemma3(path, n_layer=6, n_embd=32, n_head=4, key_length=None, window=8, pattern=None):
    kv = [KV("gemma3.attention.head_count", ValueType.UINT32, n_head)]
    if key_length is not None:
        kv.append(KV("gemma3.attention.key_length", ValueType.UINT32, key_length))
    if window is not None:
        kv.append(KV("gemma3.attention.sliding_window", ValueType.UINT32, window))
    if isinstance(pattern, int):
        kv.append(KV("gemma3.attention.sliding_window_pattern", ValueType.UINT32, pattern))
    elif pattern is not None:
        kv.append(KV("gemma3.attention.sliding_window_pattern", ValueType.ARRAY, pattern, ValueType.BOOL))
    return tiny_gguf(path, arch="gemma3", n_layer=n_layer, n_embd=n_embd, extra_kv=kv)


# As the pinned llama.cpp's load_swa_pattern(ml, 6) decides for the whole model: the
# file's per-layer array as is, else its integer period, else 6 (il % p == p - 1 global).
@pytest.mark.parametrize(
    "pattern,whole",
    [
        (None, "TTTTTF" "TTTTTF" "TT"),
        (3, "TTF" "TTF" "TTF" "TTF" "TT"),
        (0, "T" * 14),  # period 0: every layer slides
        (1, "F" * 14),  # period 1: every layer global
        ([bool(i % 4) for i in range(14)], "FTTT" "FTTT" "FTTT" "FT"),
    ],
    ids=["default", "period-3", "period-0", "period-1", "array"],
)
def test_gemma3_shard_carries_its_layers_sliding_window_pattern(tmp_path, pattern, whole):
    src = _gemma3(tmp_path / "m.gguf", n_layer=14, pattern=pattern)
    whole = tuple(c == "T" for c in whole)
    for start, end in [(0, 14), (0, 5), (5, 6), (5, 12), (7, 14), (11, 12), (13, 14)]:
        shard = read_gguf(cut_shard(src, start, end, str(tmp_path / f"s{start}-{end}.gguf")).path)
        entry = shard.kv["gemma3.attention.sliding_window_pattern"]
        assert (entry.type, entry.array_type, entry.value) == (ValueType.ARRAY, ValueType.BOOL, whole[start:end])
        # llama.cpp aborts on a windowed model without a sliding layer: such a shard has no window
        assert shard.get("gemma3.attention.sliding_window") == (8 if any(whole[start:end]) else 0)


def test_gemma3_without_a_window_is_cut_as_is(tmp_path):
    """No sliding window: llama.cpp reads no pattern and every layer is global, so
    nothing is carried (and a period key, unread, is copied as it is)."""
    src = _gemma3(tmp_path / "m.gguf", window=None, pattern=3)
    shard = read_gguf(cut_shard(src, 2, 4, str(tmp_path / "s.gguf")).path)
    assert shard.get("gemma3.attention.sliding_window_pattern") == 3
    assert shard.get("gemma3.attention.sliding_window") is None


@pytest.mark.parametrize(
    "pattern,why",
    [([True] * 5, "5 entries for 6 layers"), ((ValueType.FLOAT32, [1.0] * 6), "array of FLOAT32")],
)
def test_gemma3_pattern_llama_cpp_would_not_read_per_layer_is_refused(tmp_path, pattern, why):
    kv = [KV("gemma3.attention.head_count", ValueType.UINT32, 4),
          KV("gemma3.attention.sliding_window", ValueType.UINT32, 8)]
    vtype, values = pattern if isinstance(pattern, tuple) else (ValueType.BOOL, pattern)
    kv.append(KV("gemma3.attention.sliding_window_pattern", ValueType.ARRAY, values, vtype))
    src = tiny_gguf(tmp_path / "m.gguf", arch="gemma3", n_layer=6, extra_kv=kv)
    with pytest.raises(UncarriedLayerProperty, match=why):
        cut_shard(src, 0, 3, str(tmp_path / "s.gguf"))


def test_gemma3_27b_attention_scale_is_refused(tmp_path):
    """llama.cpp names a 62-layer gemma3 the 27B and scales its queries by
    1/sqrt(n_embd / n_head) instead of 1/sqrt(head_dim), from the layer count, with no
    key to set it: no shard of it (fewer layers) would scale the same."""
    src = _gemma3(tmp_path / "m.gguf", n_layer=62, n_embd=64, n_head=4, key_length=8)  # 64 / 4 = 16 != 8
    with pytest.raises(UncarriedLayerProperty, match=r"27B.*1/sqrt\(16\).*1/sqrt\(8\)") as e:
        cut_shard(src, 0, 31, str(tmp_path / "s.gguf"))
    assert isinstance(e.value, UnsupportedArchitecture)
    assert not os.path.exists(tmp_path / "s.gguf")
    # the same layer count with head_dim == n_embd / n_head: one scale either way
    same = _gemma3(tmp_path / "same.gguf", n_layer=62, n_embd=64, n_head=4)
    cut_shard(same, 0, 31, str(tmp_path / "s.gguf"))
    # and a 62-layer shard of a bigger gemma3 would be the "27B" its whole model is not
    bigger = _gemma3(tmp_path / "big.gguf", n_layer=70, n_embd=64, n_head=4, key_length=8)
    with pytest.raises(UncarriedLayerProperty, match="62-layer"):
        cut_shard(bigger, 4, 66, str(tmp_path / "t.gguf"))
    cut_shard(bigger, 4, 65, str(tmp_path / "t.gguf"))


def test_a_shard_is_not_cut_again(shard_dir, tmp_path):
    with pytest.raises(ShardCutError, match="itself a shard"):
        cut_shard(shard_dir[(0, 10)], 0, 5, str(tmp_path / "x.gguf"))


def test_cli_shard_cut_and_info(tmp_path, model_path):
    out = tmp_path / "tail.gguf"
    r = meshnet_peer("shard", "cut", "--model", model_path, "--layers", "20:30", "--out", str(out))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["layers"] == [20, 30] and doc["role"] == "tail"
    r = meshnet_peer("shard", "info", str(out))
    assert json.loads(r.stdout)["source_sha256"] == doc["source_sha256"]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["shard", "cut", "--layers", "0:99", "--out", "x.gguf"], "outside the model"),
        (["shard", "cut", "--layers", "banana", "--out", "x.gguf"], "A:B"),
        (["shard", "cut", "--model", "/nonexistent.gguf", "--layers", "0:1", "--out", "x.gguf"], "no model file"),
        (["shard", "info", "/etc/hostname"], "not a GGUF"),
    ],
)
def test_cli_errors_are_one_clear_line(tmp_path, args, needle):
    r = meshnet_peer(*args, cwd=tmp_path)
    assert r.returncode == 2
    assert needle in r.stderr and "Traceback" not in r.stderr
