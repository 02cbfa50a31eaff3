"""A hop's signed per-step commitment (trust/commitment.py): what it binds,
how it chains, and what it refuses to be built from."""

import dataclasses

import msgpack
import pytest
from hypothesis import given, strategies as st

from meshnet_p2p.core.identity import Identity
from meshnet_p2p.engine.contract import HIDDEN, Tensor, TensorBundle
from meshnet_p2p.trust.attestation import SEAM_DOMAIN, RowDigest
from meshnet_p2p.trust.commitment import (
    GENESIS, Commitment, CommitmentError, hidden_digest, input_digest, token_digest, tokens_digest)

PEER = Identity.from_seed(b"\x31" * 32)
OTHER = Identity.from_seed(b"\x32" * 32)


def bundle(rows: int, fill: int = 1) -> TensorBundle:
    return TensorBundle((Tensor(HIDDEN, "f32", (rows, 4), bytes([fill]) * rows * 16),))


def commitment(index: int = 0, prev: bytes = GENESIS, position: int = 0, **kw) -> Commitment:
    base = dict(peer_id=str(PEER.peer_id), session_id="s" * 32, model_digest="m" * 64, recipe_digest="r" * 64,
                start=10, end=20, route_epoch=0, index=index, position=position, decode=False,
                input_digest=hidden_digest(position, bundle(3)), output_digest=hidden_digest(position, bundle(3, 2)),
                prev=prev)
    base.update(kw)
    return Commitment(**base)


def test_digests_bind_position_content_and_kind():
    b = bundle(3)
    assert hidden_digest(0, b) == input_digest(0, b)  # a hop's output digests as the next hop's input
    assert hidden_digest(0, b) != hidden_digest(1, b)
    assert hidden_digest(0, b) != hidden_digest(0, bundle(3, 2))
    assert tokens_digest(5, [7]) == input_digest(5, (7,))
    assert tokens_digest(5, [7]) != tokens_digest(5, [8]) != tokens_digest(6, [8])
    assert token_digest(5, 7, False) != token_digest(5, 7, True)  # is_eog is part of the output
    assert token_digest(5, 7, False) != tokens_digest(5, [7])  # kinds are framed apart
    # another domain than the attestation's running digests: a step digest is never a row digest
    row = RowDigest(SEAM_DOMAIN)
    row.hidden(0, b)
    assert bytes.fromhex(row.hexdigest()) != hidden_digest(0, b)


def test_a_signed_commitment_verifies_and_any_change_breaks_it():
    c = commitment().signed_by(PEER)
    assert c.verifies()
    changes = dict(peer_id=str(OTHER.peer_id), session_id="t" * 32, model_digest="n" * 64, recipe_digest="q" * 64,
                   start=11, end=21, route_epoch=1, index=1, position=1, decode=True,
                   input_digest=b"\1" * 32, output_digest=b"\2" * 32, prev=b"\3" * 32)
    for name, value in changes.items():
        assert not dataclasses.replace(c, **{name: value}).verifies(), name
    assert not dataclasses.replace(c, signature=bytes(64)).verifies()
    assert not commitment().verifies()  # unsigned
    with pytest.raises(CommitmentError):
        commitment().signed_by(OTHER)  # signed by the peer it names only


def test_commitments_chain_by_link():
    first = commitment().signed_by(PEER)
    second = commitment(index=1, prev=first.link(), position=3).signed_by(PEER)
    assert first.follows(None) and second.follows(first)
    assert not second.follows(None) and not first.follows(second)
    forged = commitment(index=1, prev=b"\0" * 31 + b"\1", position=3).signed_by(PEER)
    assert not forged.follows(first)
    assert first.link() != second.link() and len(first.link()) == 32
    # the link does not cover the signature: it names the step, not the signing
    assert first.link() == commitment().link()


def test_a_rollback_resumes_the_chain_from_the_commitment_before_it():
    """Steps 0 and 1, a rollback to the end of step 0, and step 1 again on the next
    epoch: it follows step 0 as the first step 1 did, and does not equivocate with it."""
    s0 = commitment().signed_by(PEER)
    s1 = commitment(index=1, prev=s0.link(), position=3).signed_by(PEER)
    again = commitment(index=1, prev=s0.link(), position=3, route_epoch=1).signed_by(PEER)
    assert again.follows(s0) and again.link() != s1.link()


def test_content_round_trips_through_msgpack():
    c = commitment().signed_by(PEER)
    back = Commitment.from_content(msgpack.unpackb(msgpack.packb(c.to_content(), use_bin_type=True), raw=False))
    assert back == c and back.verifies()


@pytest.mark.parametrize("change", [
    {"index": -1}, {"index": 1 << 40}, {"index": True}, {"position": "0"}, {"start": 1.5},
    {"peer_id": "p" * 129}, {"session_id": b"s"}, {"model_digest": "m" * 129},
    {"input_digest": b"\0" * 31}, {"output_digest": "0" * 32}, {"prev": b"\0" * 33},
    {"signature": b"\0" * 63}, {"decode": 1},
])
def test_out_of_bounds_content_is_refused(change):
    content = commitment().signed_by(PEER).to_content()
    content.update(change)
    with pytest.raises(CommitmentError):
        Commitment.from_content(content)


def test_content_must_name_exactly_the_fields():
    content = commitment().to_content()
    with pytest.raises(CommitmentError):
        Commitment.from_content({**content, "extra": 1})
    content.pop("prev")
    with pytest.raises(CommitmentError):
        Commitment.from_content(content)
    with pytest.raises(CommitmentError):
        Commitment.from_content([1, 2])


_values = st.one_of(st.none(), st.booleans(), st.integers(), st.binary(max_size=70), st.text(max_size=140),
                    st.lists(st.integers(), max_size=3))


@given(st.dictionaries(st.sampled_from([f.name for f in dataclasses.fields(Commitment)] + ["x"]), _values))
def test_from_content_of_anything_is_a_commitment_or_a_commitment_error(content):
    try:
        c = Commitment.from_content(content)
    except CommitmentError:
        return
    assert c.to_content() == content
    c.link()  # a parsed commitment can always be hashed and checked
    assert not c.verifies() or len(c.signature) == 64


def test_link_is_the_canonical_msgpack_of_the_body():
    """link() packs its flat body directly (it is on every step's path): the bytes are the
    ones core.records.canonical gives, which the signatures already in records cover."""
    import hashlib

    from meshnet_p2p.core.records import canonical
    from meshnet_p2p.trust.commitment import COMMIT_DOMAIN

    for c in [commitment(), commitment(7, b"\x01" * 32, 2**39, decode=True)]:
        body = [getattr(c, f.name) for f in dataclasses.fields(c) if f.name != "signature"]
        assert c.link() == hashlib.sha256(COMMIT_DOMAIN + canonical(body)).digest()
