"""A model's manifest (engine/manifest.py) and a partial copy of its file
(engine/partial.py): a shard cut from only the parts a span needs, each checked
against the manifest, is byte-identical to one cut from the whole file (issue 29,
points 1 and 3); bad parts and bad manifests are typed errors, never stored."""

from __future__ import annotations

import dataclasses
import hashlib
import os

import msgpack
import pytest
from hypothesis import given, strategies as st

from meshnet_p2p.engine.cut import cut_shard, inspect_gguf, tensors_needed
from meshnet_p2p.engine.gguf import read_gguf
from meshnet_p2p.engine.manifest import Manifest, ManifestError, TensorEntry, build_manifest
from meshnet_p2p.engine.partial import HEADER, MissingParts, PartialModel

from tests.test_architectures import write_tiny_model


@pytest.fixture(scope="module")
def manifest(model_path) -> Manifest:
    return build_manifest(model_path)


def file_bytes(path: str, lo: int, hi: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(lo)
        return f.read(hi - lo)


def same_file(a: str, b: str) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        return fa.read() == fb.read()


def fetch(partial: PartialModel, source: str, names) -> int:
    """What a fetcher does with parts it got: put each; the bytes it moved."""
    m = partial.manifest
    moved = 0
    for name in names:
        if name == HEADER:
            data = file_bytes(source, 0, m.header_size)
            partial.put_header(data)
        else:
            data = file_bytes(source, *m.span(m.tensor(name)))
            partial.put_tensor(name, data)
        moved += len(data)
    return moved


def test_the_manifest_describes_the_file(model_path, model_digest, manifest):
    src = read_gguf(model_path)
    assert manifest.source_sha256 == model_digest
    assert manifest.model_digest == inspect_gguf(model_path, source_sha256=model_digest).model_digest
    assert (manifest.file_size, manifest.header_size) == (os.path.getsize(model_path), src.data_offset)
    assert [t.name for t in manifest.tensors] == [t.name for t in src.tensors]
    for t in manifest.tensors[:5]:
        assert hashlib.sha256(file_bytes(model_path, *manifest.span(t))).digest() == t.sha256
    assert Manifest.from_bytes(manifest.to_bytes()) == manifest
    assert len(manifest.digest()) == 64


@pytest.mark.parametrize("span", [(0, 10), (10, 20), (20, 30), (0, 30), (7, 23)])
def test_a_shard_of_fetched_parts_is_the_shard_cut_from_the_file(tmp_path, model_path, model_digest, manifest, span):
    start, end = span
    partial = PartialModel(str(tmp_path / "models"), manifest)
    with pytest.raises(MissingParts):
        partial.needed(start, end)  # which tensors: the header says
    moved = fetch(partial, model_path, [HEADER])
    need = [t.name for t in partial.needed(start, end)]
    assert need == [t.name for t in tensors_needed(read_gguf(model_path), start, end)]
    with pytest.raises(MissingParts):
        partial.cut(start, end, str(tmp_path / "early.gguf"))
    moved += fetch(partial, model_path, need)
    assert partial.missing(start, end) == ()
    ours = partial.cut(start, end, str(tmp_path / "fetched.gguf"))
    theirs = cut_shard(model_path, start, end, str(tmp_path / "cut.gguf"), source_sha256=model_digest)
    assert same_file(ours.path, theirs.path)
    # what a volunteer moves is its span's share of the file (and the head or tail's embedding)
    assert moved < manifest.file_size * ((end - start) / 30 + 0.35)


def test_every_architecture_and_role_cuts_the_same_from_parts(tmp_path):
    for arch in ("gemma3", "qwen2"):
        model = write_tiny_model(str(tmp_path / f"{arch}.gguf"), arch)
        m = build_manifest(model)
        n = m.n_layer
        for start, end in [(0, 2), (2, n - 1), (n - 1, n)]:
            partial = PartialModel(str(tmp_path / "models"), m)
            fetch(partial, model, [HEADER])
            fetch(partial, model, [t.name for t in partial.missing(start, end)])
            ours = partial.cut(start, end, str(tmp_path / f"{arch}-{start}-f.gguf"))
            theirs = cut_shard(model, start, end, str(tmp_path / f"{arch}-{start}-c.gguf"))
            assert same_file(ours.path, theirs.path), (arch, start, end)


def test_a_part_that_is_not_the_files_is_refused_and_not_stored(tmp_path, model_path, manifest):
    partial = PartialModel(str(tmp_path / "models"), manifest)
    header = file_bytes(model_path, 0, manifest.header_size)
    with pytest.raises(ManifestError, match="header"):
        partial.put_header(header[:-1] + bytes([header[-1] ^ 1]))
    partial.put_header(header)
    t = manifest.tensors[3]
    good = file_bytes(model_path, *manifest.span(t))
    for bad in (good[:-1] + bytes([good[-1] ^ 1]), good[:-1], good + b"\0"):
        with pytest.raises(ManifestError, match=t.name):
            partial.put_tensor(t.name, bad)
    with pytest.raises(ManifestError, match="no tensor"):
        partial.put_tensor("blk.99.nothing", good)
    assert t.name not in partial.present
    assert file_bytes(partial.path, *manifest.span(t)) == bytes(t.nbytes)  # still a hole


def test_a_killed_fetch_resumes_with_what_it_had(tmp_path, model_path, manifest):
    root = str(tmp_path / "models")
    partial = PartialModel(root, manifest)
    fetch(partial, model_path, [HEADER])
    need = [t.name for t in partial.needed(0, 10)]
    fetch(partial, model_path, need[: len(need) // 2])
    with open(partial.path + ".parts", "a") as j:
        j.write('"blk.3.ffn_up')  # torn: the kill came mid-append
    # one stored part rots on disk meanwhile
    rotten = manifest.tensor(need[1])
    with open(partial.path, "r+b") as f:
        f.seek(manifest.span(rotten)[0])
        f.write(b"\xff")
    again = PartialModel(root, manifest)
    assert again.header is not None
    assert [t.name for t in again.missing(0, 10)] == [n for n in need if n == need[1] or n not in need[: len(need) // 2]]
    fetch(again, model_path, [t.name for t in again.missing(0, 10)])
    assert PartialModel(root, manifest).missing(0, 10) == ()
    again.cut(0, 10, str(tmp_path / "s.gguf"))


def test_a_header_that_hashes_right_must_give_the_manifests_table(model_path, manifest):
    # a manifest that moves a tensor (rehashed) no longer matches the header it names
    t0, t1 = manifest.tensors[0], manifest.tensors[1]
    swapped = dataclasses.replace(manifest, tensors=(dataclasses.replace(t0, sha256=t1.sha256),
                                                     dataclasses.replace(t1, sha256=t0.sha256)) + manifest.tensors[2:])
    swapped.check_header(file_bytes(model_path, 0, manifest.header_size))  # sums are not in the table
    renamed = dataclasses.replace(manifest, tensors=(dataclasses.replace(t0, name="renamed"),) + manifest.tensors[1:])
    with pytest.raises(ManifestError, match="other tensors"):
        renamed.check_header(file_bytes(model_path, 0, manifest.header_size))
    other_arch = dataclasses.replace(manifest, architecture="qwen2")
    with pytest.raises(ManifestError, match="architecture"):
        other_arch.check_header(file_bytes(model_path, 0, manifest.header_size))


@pytest.mark.parametrize("change, why", [
    (lambda c: c.update(v=2), "version"),
    (lambda c: c.update(extra=1), "exactly"),
    (lambda c: c.update(source_sha256="A" * 64), "hex"),
    (lambda c: c.update(file_name="../../etc/passwd"), "plain file name"),
    (lambda c: c.update(file_size=c["header_size"]), "past the end"),
    (lambda c: c.update(header_size=0), "header_size"),
    (lambda c: c["tensors"].append(list(c["tensors"][0])), "twice"),
    (lambda c: c["tensors"][1].__setitem__(3, c["tensors"][0][3]), "overlaps"),
    (lambda c: c["tensors"][0].__setitem__(4, c["tensors"][0][4] + 1), "type and dims make"),
    (lambda c: c["tensors"][0].__setitem__(1, 9999), "type ggml does not know"),
    (lambda c: c["tensors"][0].__setitem__(2, []), "dims"),
    (lambda c: c["tensors"][0].__setitem__(5, b"x"), "sha256"),
    (lambda c: c.update(tensors=[]), "1-"),
])
def test_a_malformed_manifest_is_one_typed_error(manifest, change, why):
    content = msgpack.unpackb(manifest.to_bytes(), raw=False)
    change(content)
    with pytest.raises(ManifestError, match=why):
        Manifest.from_bytes(msgpack.packb(content, use_bin_type=True))


def test_a_manifest_has_one_encoding(manifest):
    content = msgpack.unpackb(manifest.to_bytes(), raw=False)
    reordered = msgpack.packb(dict(reversed(list(content.items()))), use_bin_type=True)
    with pytest.raises(ManifestError, match="canonical"):
        Manifest.from_bytes(reordered)


@given(st.binary(max_size=512))
def test_any_bytes_decode_to_a_manifest_or_a_manifest_error(data):
    try:
        Manifest.from_bytes(data)
    except ManifestError:
        pass


_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2, 2**64), st.binary(max_size=40), st.text(max_size=20))


@given(st.recursive(_leaf, lambda kids: st.lists(kids, max_size=6) | st.dictionaries(st.text(max_size=14), kids, max_size=10),
                    max_leaves=40))
def test_any_msgpack_content_is_a_manifest_or_a_manifest_error(content):
    try:
        Manifest.from_content(content)
    except ManifestError:
        pass


@given(st.integers(0, 8), st.integers(0, 5), st.sampled_from([-1, 0, 1, 2**41, "x", None, b"", [], 1.5]))
def test_any_field_of_a_real_manifest_mutated_is_still_checked(manifest_small, row, col, value):
    content = msgpack.unpackb(manifest_small.to_bytes(), raw=False)
    keys = sorted(content)
    if row < len(keys) and col == 0:
        content[keys[row]] = value
    else:
        content["tensors"][row % len(content["tensors"])][col] = value
    try:
        m = Manifest.from_content(content)
    except ManifestError:
        return
    assert isinstance(m, Manifest) and all(isinstance(t, TensorEntry) for t in m.tensors)


@pytest.fixture(scope="module")
def manifest_small(tmp_path_factory) -> Manifest:
    return build_manifest(write_tiny_model(str(tmp_path_factory.mktemp("tiny") / "llama.gguf"), "llama"))
