"""Recipe identity: conformance vectors, axis sensitivity, derivation from what
runs, and the binding that ties a cut shard to its bytes."""

import ctypes
import dataclasses
import hashlib
import itertools
import json
import os
import shutil
import struct

import llama_cpp
import pytest

from meshnet_p2p.engine import recipe as R
from meshnet_p2p.engine.contract import LoadRequest, StatusCode
from meshnet_p2p.engine.cut import (
    BINDING_DOMAIN,
    K_DATA_SHA256,
    K_FILE_TYPE,
    K_SOURCE_TOKENIZER,
    ShardBindingError,
    ShardCutError,
    cut_shard,
    inspect_gguf,
    verify_shard,
)
from meshnet_p2p.engine.gguf import (
    GGML_BLOCKS,
    GGUFFormatError,
    OutTensor,
    ValueType,
    KV,
    encode_string,
    read_gguf,
    tensor_nbytes,
    write_gguf,
)
from meshnet_p2p.engine.llama_engine import LlamaCppShardEngine
from meshnet_p2p.core.errors import MeshnetError

VECTORS = json.load(open(os.path.join(os.path.dirname(__file__), "data", "recipe_vectors.json")))
BINDING_MESSAGE = "shard bytes do not match the binding it claims"


def _recipe(vector) -> R.Recipe:
    return R.Recipe(**vector["axes"], **vector["labels"])


# --- conformance vectors -----------------------------------------------------------


@pytest.mark.parametrize("vector", VECTORS["recipes"], ids=lambda v: v["name"])
def test_recipe_digest_matches_its_vector(vector):
    r = _recipe(vector)
    assert r.axes() == vector["axes"]
    assert r.labels() == vector["labels"]
    assert r.digest() == vector["digest"] == R.recipe_digest(vector["axes"])
    # the canonical preimage is spelled out so other implementations can check it
    assert hashlib.sha256(vector["canonical"].encode()).hexdigest() == vector["digest"]
    assert json.loads(vector["canonical"]) == {"domain": VECTORS["recipe_domain"], "body": vector["axes"]}
    assert VECTORS["recipe_domain"] == R.RECIPE_DOMAIN


@pytest.mark.parametrize("vector", VECTORS["recipes"], ids=lambda v: v["name"])
def test_vector_axes_are_exactly_the_recipe_axes(vector):
    assert list(vector["axes"]) == list(R.RECIPE_AXES)
    assert set(vector["labels"]) == set(R.RECIPE_LABELS)


def test_recipe_fields_are_the_axes_and_the_labels():
    assert [f.name for f in dataclasses.fields(R.Recipe)] == [*R.RECIPE_AXES, *R.RECIPE_LABELS]


@pytest.mark.parametrize("vector", VECTORS["models"], ids=lambda v: v["architecture"])
def test_model_digest_matches_its_vector(vector):
    assert R.model_digest(vector["source_sha256"], vector["architecture"], vector["n_layer"]) == vector["digest"]
    assert hashlib.sha256(vector["canonical"].encode()).hexdigest() == vector["digest"]
    assert VECTORS["model_domain"] == R.MODEL_DOMAIN


@pytest.mark.parametrize("vector", VECTORS["cpu_features"])
def test_cpu_features_parse(vector):
    assert R.parse_cpu_features(vector["system_info"]) == vector["features"]


def test_no_cpu_features_is_refused():
    with pytest.raises(R.RecipeError):
        R.parse_cpu_features("CUDA : ARCHS = 890 | ")


@pytest.mark.parametrize("ftype,name", VECTORS["ftypes"])
def test_ftype_names(ftype, name):
    assert R.ftype_name(ftype) == name


def test_ftype_table_agrees_with_llama_cpp():
    theirs = {v: k.removeprefix("LLAMA_FTYPE_").removeprefix("MOSTLY_").removeprefix("ALL_")
              for k, v in vars(llama_cpp).items() if k.startswith("LLAMA_FTYPE_") and k != "LLAMA_FTYPE_GUESSED"}
    assert {k: theirs.get(k) for k in R.LLAMA_FTYPES} == dict(R.LLAMA_FTYPES)
    assert R.LLAMA_FTYPE_GUESSED == llama_cpp.LLAMA_FTYPE_GUESSED
    # llama.cpp may know file types newer than the pinned gguf-py release (0.19.0 lacks
    # Q2_0). Their tensor types are newer too, so the reader refuses such a file before
    # anything names its type; when gguf-py catches up the names come with it.
    for ftype in theirs.keys() - R.LLAMA_FTYPES.keys():
        tensor_type = getattr(llama_cpp, f"GGML_TYPE_{theirs[ftype]}")
        assert tensor_type not in GGML_BLOCKS
        with pytest.raises(GGUFFormatError, match="unsupported ggml tensor type"):
            tensor_nbytes(tensor_type, (256,))


# --- sensitivity -------------------------------------------------------------------


def _other(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    return value + "x"


@pytest.mark.parametrize("axis", R.RECIPE_AXES)
def test_changing_any_axis_changes_the_digest(axis):
    for vector in VECTORS["recipes"]:
        r = _recipe(vector)
        changed = dataclasses.replace(r, **{axis: _other(getattr(r, axis))})
        assert changed.digest() != r.digest()


@pytest.mark.parametrize("label", R.RECIPE_LABELS)
def test_changing_a_label_does_not_change_the_digest(label):
    r = _recipe(VECTORS["recipes"][0])
    assert dataclasses.replace(r, **{label: "renamed"}).digest() == r.digest()


def test_swapping_two_axis_values_changes_the_digest():
    swapped = 0
    for vector in VECTORS["recipes"]:
        r = _recipe(vector)
        for a, b in itertools.combinations(R.RECIPE_AXES, 2):
            va, vb = getattr(r, a), getattr(r, b)
            if type(va) is type(vb) and va != vb:
                assert dataclasses.replace(r, **{a: vb, b: va}).digest() != r.digest(), (a, b)
                swapped += 1
    assert swapped > 50


@pytest.mark.parametrize(
    "axis,value", [("n_ubatch", "64"), ("n_ubatch", True), ("flash_attn", 0), ("seam_dtype", ""), ("kv_dtype", None)]
)
def test_an_axis_of_the_wrong_type_is_refused(axis, value):
    with pytest.raises(R.RecipeError, match=axis):
        dataclasses.replace(_recipe(VECTORS["recipes"][0]), **{axis: value})


def test_digest_of_other_axes_is_refused():
    axes = dict(VECTORS["recipes"][0]["axes"])
    with pytest.raises(R.RecipeError, match="unknown"):
        R.recipe_digest({**axes, "new_axis": 1})
    del axes["kv_dtype"]
    with pytest.raises(R.RecipeError, match="missing"):
        R.recipe_digest(axes)


def test_mismatch_names_each_axis():
    a, b = VECTORS["recipes"][0]["axes"], VECTORS["recipes"][1]["axes"]
    assert R.differing_axes(a, b) == ["n_ubatch", "seam_dtype"]
    assert R.explain_mismatch(a, b) == ["n_ubatch is 32 there, 64 here", "seam_dtype is 'f16' there, 'f32' here"]
    assert R.differing_axes(a, {k: v for k, v in a.items() if k != "cpu_features"}) == ["cpu_features"]
    assert R.differing_axes(a, a) == []


def test_settings_are_named_from_the_values_set():
    assert R.kv_dtype_name(R.KV_CACHE_GGML_TYPE) == "f16"
    assert R.kv_layout_name(R.KV_UNIFIED) == "per-sequence"
    assert R.flash_attn_enabled(R.FLASH_ATTN_TYPE) is False
    assert R.FLASH_ATTN_TYPE == llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    assert R.KV_CACHE_GGML_TYPE == llama_cpp.GGML_TYPE_F16
    with pytest.raises(R.RecipeError, match="AUTO"):
        R.flash_attn_enabled(llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO)


# --- derived from what runs --------------------------------------------------------


def _ggml_commit() -> str:
    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so.0"))
    lib.ggml_commit.restype = ctypes.c_char_p
    return lib.ggml_commit().decode()


RANGES = [(0, 10), (10, 20), (20, 30)]


def test_loaded_recipe_is_derived_from_what_runs(shard_dir, load_engine, model_path, model_digest):
    whole = load_engine(model_path, source_sha256=model_digest).capabilities()
    commit = _ggml_commit()
    assert commit and f"({commit})" in whole.recipe["llama_build"]
    assert whole.recipe["llama_build"].startswith("ggml ") and ", llama " in whole.recipe["llama_build"]
    assert "llama-cpp-python" not in whole.recipe["llama_build"]
    assert whole.recipe["cpu_features"] and "SSE3" in whole.recipe["cpu_features"].split(",")
    assert whole.recipe["weight_quantization"] == "Q4_1"
    assert (whole.recipe["kv_dtype"], whole.recipe["kv_layout"], whole.recipe["flash_attn"]) == ("f16", "per-sequence", False)
    assert list(whole.recipe) == list(R.RECIPE_AXES)
    assert R.recipe_digest(whole.recipe) == whole.recipe_digest
    assert whole.recipe_labels == {"recipe_name": "default", "recipe_version": "1"}
    for r in RANGES:
        caps = load_engine(shard_dir[r]).capabilities()
        assert caps.recipe == whole.recipe, r
        assert caps.recipe_digest == whole.recipe_digest, r
        assert caps.model_digest == whole.model_digest, r


def test_other_micro_batch_or_seam_is_another_recipe(shard_dir, load_engine):
    base = load_engine(shard_dir[(10, 20)]).capabilities()
    other_ubatch = load_engine(shard_dir[(10, 20)], n_ubatch=16).capabilities()
    other_seam = load_engine(shard_dir[(10, 20)], seam_dtype="bf16").capabilities()
    assert len({base.recipe_digest, other_ubatch.recipe_digest, other_seam.recipe_digest}) == 3
    assert R.differing_axes(base.recipe, other_ubatch.recipe) == ["n_ubatch"]
    assert R.differing_axes(base.recipe, other_seam.recipe) == ["seam_dtype"]


def test_tokenizer_digest_is_the_sources_in_every_shard(shard_dir, model_path, model_digest):
    whole = inspect_gguf(model_path, source_sha256=model_digest)
    assert len(whole.tokenizer_digest) == 64 and whole.weight_quantization == "Q4_1" and whole.data_sha256 is None
    source_ftype = read_gguf(model_path).get(K_FILE_TYPE)
    for r in RANGES:
        info = inspect_gguf(shard_dir[r])
        assert info.tokenizer_digest == whole.tokenizer_digest, r
        assert info.weight_quantization == "Q4_1"
        f = read_gguf(shard_dir[r])
        assert f.get(K_SOURCE_TOKENIZER) == whole.tokenizer_digest
        assert f.get(K_FILE_TYPE) == source_ftype  # general.file_type survives cutting
    assert read_gguf(shard_dir[(10, 20)]).get("tokenizer.ggml.model") == "none"  # yet its digest is the source's


# --- the shard binding -------------------------------------------------------------


@pytest.fixture
def middle_copy(shard_dir, tmp_path):
    path = str(tmp_path / "middle.gguf")
    shutil.copyfile(shard_dir[(10, 20)], path)
    return path


def _load_status(path):
    engine = LlamaCppShardEngine()
    try:
        return engine.load(LoadRequest(path, n_threads=1, max_sessions=1, n_ctx_per_session=256)).status
    finally:
        engine.close()


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def test_binding_covers_every_byte_but_its_own_entry(middle_copy):
    f = read_gguf(middle_copy)
    lo, hi = f.kv[K_DATA_SHA256].span
    raw = open(middle_copy, "rb").read()
    expected = hashlib.sha256(encode_string(BINDING_DOMAIN) + raw[:lo] + raw[hi:]).hexdigest()
    assert f.get(K_DATA_SHA256) == expected == verify_shard(middle_copy) == inspect_gguf(middle_copy).data_sha256


def test_a_flipped_tensor_byte_is_refused(middle_copy):
    f = read_gguf(middle_copy)
    t = f.tensor("blk.3.ffn_down.weight")
    _flip(middle_copy, f.data_offset + t.offset + t.nbytes // 2)
    with pytest.raises(ShardBindingError, match=BINDING_MESSAGE):
        inspect_gguf(middle_copy)
    status = _load_status(middle_copy)
    assert status.code is StatusCode.LOAD_FAILED and BINDING_MESSAGE in status.message


def test_an_edited_metadata_value_is_refused(middle_copy):
    f = read_gguf(middle_copy)
    lo, hi = f.kv["llama.rope.freq_base"].span
    _flip(middle_copy, hi - 1)
    with pytest.raises(ShardBindingError, match=BINDING_MESSAGE):
        inspect_gguf(middle_copy)


@pytest.mark.parametrize("keep", [0.5, -1])
def test_a_truncated_shard_is_a_typed_error(middle_copy, keep):
    size = os.path.getsize(middle_copy)
    with open(middle_copy, "r+b") as f:
        f.truncate(int(size * keep) if keep > 0 else size + keep)
    with pytest.raises(MeshnetError, match="truncated|" + BINDING_MESSAGE):
        inspect_gguf(middle_copy)
    status = _load_status(middle_copy)
    assert status.code is StatusCode.LOAD_FAILED
    assert "truncated" in status.message or BINDING_MESSAGE in status.message


def test_appended_bytes_are_refused(middle_copy):
    with open(middle_copy, "ab") as f:
        f.write(b"\0")
    with pytest.raises(ShardBindingError, match=BINDING_MESSAGE):
        inspect_gguf(middle_copy)


def test_a_shard_claiming_no_binding_is_refused(middle_copy):
    raw = bytearray(open(middle_copy, "rb").read())
    key = K_DATA_SHA256.encode()
    i = raw.index(key)
    raw[i + len(key) - 1 : i + len(key)] = b"X"  # the key is renamed: no binding claimed
    open(middle_copy, "wb").write(raw)
    with pytest.raises(ShardBindingError, match=f"no {K_DATA_SHA256}"):
        inspect_gguf(middle_copy)


def test_a_head_whose_tokenizer_is_not_the_sources_is_refused(shard_dir, tmp_path):
    # Rewrite a head's recorded source tokenizer digest and re-bind it: the binding
    # holds, but the tokenizer the head runs is not the one its recipe names.
    path = str(tmp_path / "head.gguf")
    shutil.copyfile(shard_dir[(0, 10)], path)
    f = read_gguf(path)
    lo, hi = f.kv[K_SOURCE_TOKENIZER].span
    raw = bytearray(open(path, "rb").read())
    raw[hi - 64 : hi] = b"ab" * 32
    b_lo, b_hi = f.kv[K_DATA_SHA256].span
    raw[b_hi - 64 : b_hi] = hashlib.sha256(encode_string(BINDING_DOMAIN) + raw[:b_lo] + raw[b_hi:]).hexdigest().encode()
    open(path, "wb").write(raw)
    verify_shard(path)
    with pytest.raises(ShardBindingError, match="tokenizer"):
        inspect_gguf(path)


def test_an_old_format_shard_is_refused_and_recut(monkeypatch, tmp_path, model_path, model_digest):
    from meshnet_p2p.engine import models

    monkeypatch.setenv("MESHNET_CACHE_DIR", str(tmp_path / "cache"))
    path = models.shard_cache_path(model_digest, 10, 20)
    os.makedirs(os.path.dirname(path))
    tiny = _tiny_gguf(
        tmp_path / "old.gguf",
        extra_kv=[KV("meshnet.format_version", ValueType.UINT32, 1),
                  KV("meshnet.source.sha256", ValueType.STRING, model_digest)],
    )
    shutil.copyfile(tiny, path)
    with pytest.raises(ShardCutError, match="format version 1"):
        inspect_gguf(path)
    assert models.ensure_shard(model_path, 10, 20, model_digest) == path
    info = inspect_gguf(path)
    assert (info.start, info.end, info.source_sha256) == (10, 20, model_digest) and info.data_sha256


def _tiny_gguf(path, n_layer=2, n_embd=32, extra_kv=()):
    kv = [
        KV("general.architecture", ValueType.STRING, "llama"),
        KV("llama.block_count", ValueType.UINT32, n_layer),
        KV("llama.embedding_length", ValueType.UINT32, n_embd),
        *extra_kv,
    ]
    row = struct.pack(f"<{n_embd}f", *range(n_embd))
    tensors = [OutTensor("token_embd.weight", (n_embd, 1), 0, len(row), data=row),
               OutTensor("output_norm.weight", (n_embd,), 0, len(row), data=row)]
    tensors += [OutTensor(f"blk.{i}.attn_norm.weight", (n_embd,), 0, len(row), data=row) for i in range(n_layer)]
    write_gguf(str(path), kv, tensors, source_path=None)
    return str(path)


def test_a_model_without_file_type_or_tokenizer_still_cuts(tmp_path):
    src = _tiny_gguf(tmp_path / "m.gguf", n_layer=3)
    info = cut_shard(src, 1, 2, str(tmp_path / "s.gguf"))
    assert info == inspect_gguf(str(tmp_path / "s.gguf"))
    assert info.weight_quantization == "unspecified"
    assert info.tokenizer_digest == inspect_gguf(src).tokenizer_digest
    assert not [p for p in os.listdir(tmp_path) if p.endswith((".unbound", ".partial"))]
