"""A certifier's catalogue of model names (trust/catalogue.py): signed, bounded, and
resolved over trusted certifiers only; a name with two files is shown, never chosen."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from meshnet_p2p.core.identity import Identity
from meshnet_p2p.core.records import RecordRejected, RecordVerifier, sign_record
from meshnet_p2p.swarm.node import TYPES
from meshnet_p2p.trust.catalogue import (
    CATALOGUE,
    MAX_ENTRIES,
    CatalogueError,
    Entry,
    _valid,
    catalogue_key,
    entries_of,
    names,
    resolve,
    sign_catalogue,
    with_entry,
)

NOW = 1_800_000_000_000
ALICE, BOB, MALLORY = (Identity.from_seed(bytes([i]) * 32) for i in (1, 2, 3))
SMOL = Entry("SmolLM2-135M-Instruct", "a" * 64, "b" * 64, 100)
GEMMA = Entry("gemma-3-270m", "c" * 64, "d" * 64, 200)


def record(identity: Identity, entries, now: int = NOW):
    return RecordVerifier(TYPES).verify(sign_catalogue(identity, entries, now_ms=now), NOW + 1)


def test_a_catalogue_is_a_signed_record_under_its_certifiers_key():
    r = record(ALICE, [SMOL, GEMMA])
    assert r.content["key"] == catalogue_key(str(ALICE.peer_id))
    assert entries_of(r) == [SMOL, GEMMA]


def test_nobody_signs_for_anothers_catalogue():
    content = {"key": catalogue_key(str(ALICE.peer_id)), "certifier": str(ALICE.peer_id), "entries": []}
    wire = sign_record(MALLORY, CATALOGUE, content, seq=NOW, now_ms=NOW, ttl_ms=60_000)
    with pytest.raises(RecordRejected):
        RecordVerifier(TYPES).verify(wire, NOW + 1)


def test_a_name_resolves_over_trusted_certifiers_only():
    mine = [record(ALICE, [SMOL]), record(MALLORY, [GEMMA, Entry("SmolLM2-135M-Instruct", "e" * 64, "f" * 64, 1)])]
    trusted = [str(ALICE.peer_id)]
    assert resolve("SmolLM2-135M-Instruct", mine, trusted).entry == SMOL  # Mallory's other file is not seen
    with pytest.raises(CatalogueError, match="no certifier this client trusts"):
        resolve("gemma-3-270m", mine, trusted)
    assert set(names(mine, trusted)) == {"SmolLM2-135M-Instruct"}


def test_two_files_under_one_name_are_shown_never_chosen():
    other = Entry("SmolLM2-135M-Instruct", "e" * 64, "f" * 64, 1)
    recs = [record(ALICE, [SMOL]), record(BOB, [other])]
    with pytest.raises(CatalogueError, match="2 different files") as e:
        resolve(SMOL.name, recs, [str(ALICE.peer_id), str(BOB.peer_id)])
    assert "aaaaaaaaaaaa" in str(e.value) and "eeeeeeeeeeee" in str(e.value)
    # two certifiers agreeing are one answer, vouched twice
    both = resolve(SMOL.name, [record(ALICE, [SMOL]), record(BOB, [SMOL])], [str(ALICE.peer_id), str(BOB.peer_id)])
    assert both.entry == SMOL and len(both.certifiers) == 2


def test_a_certifiers_newest_catalogue_counts():
    old, new = record(ALICE, [SMOL], NOW - 10), record(ALICE, [GEMMA], NOW)
    assert set(names([new, old], [str(ALICE.peer_id)])) == {"gemma-3-270m"}


def test_adding_an_entry_replaces_the_same_one_and_bounds_the_list():
    entries = [Entry(f"m{i}", f"{i:064x}", "b" * 64, 1) for i in range(MAX_ENTRIES)]
    grown = with_entry(entries, SMOL)
    assert grown[0] == SMOL and len(grown) == MAX_ENTRIES and entries[-1] not in grown
    again = with_entry(grown, Entry(SMOL.name, SMOL.model_digest, "9" * 64, 5))
    assert [e.name for e in again].count(SMOL.name) == 1 and again[0].manifest_digest == "9" * 64
    with pytest.raises(CatalogueError):
        with_entry([], Entry("../x", "a" * 64, "b" * 64, 1))


@pytest.mark.parametrize("name", ["", "-x", "a b", "a/b", "x" * 97, "é", 5])
def test_a_bad_name_is_refused(name):
    with pytest.raises(CatalogueError):
        resolve(name, [], [])
    content = {"key": catalogue_key("p"), "certifier": "p",
               "entries": [{"name": name, "model_digest": "a" * 64, "manifest_digest": "b" * 64, "file_size": 1}]}
    assert _valid(content) is not None


_leaf = st.one_of(st.none(), st.booleans(), st.integers(-1, 2**60), st.binary(max_size=8), st.text(max_size=70))


@given(st.recursive(_leaf, lambda k: st.lists(k, max_size=4) | st.dictionaries(st.text(max_size=16), k, max_size=6),
                    max_leaves=30))
def test_any_content_is_valid_or_has_a_reason(content):
    why = _valid(content)
    assert why is None or isinstance(why, str)
