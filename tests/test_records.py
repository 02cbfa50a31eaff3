"""Signed records: every rejection reason, and fuzzed envelopes."""

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshnet_p2p.core.identity import Identity
from meshnet_p2p.core.records import (
    DOMAIN,
    MAX_RECORD_BYTES,
    PayloadType,
    RecordRejected,
    RecordVerifier,
    Reject,
    canonical,
    sign_record,
)

CAP = "meshnet/capability/v1"
TYPES = {CAP: PayloadType(CAP, max_payload_bytes=2048, replay_key_field="model")}
NOW = 1_800_000_000_000
ALICE = Identity.from_seed(bytes(range(32)))
MALLORY = Identity.from_seed(bytes(range(1, 33)))


def report(ident=ALICE, **extra):
    return {"peer_id": str(ident.peer_id), "model": "abc", "layers": [0, 10], **extra}


def signed(ident=ALICE, content=None, *, seq=1, now=NOW, ttl=60_000, ptype=CAP):
    return sign_record(ident, ptype, content if content is not None else report(ident), seq=seq, now_ms=now, ttl_ms=ttl)


def rejected(wire, now=NOW, verifier=None):
    v = verifier or RecordVerifier(TYPES)
    with pytest.raises(RecordRejected) as e:
        v.verify(wire, now)
    return e.value.reason


def test_a_good_record_verifies():
    rec = RecordVerifier(TYPES).verify(signed(), NOW)
    assert rec.signer == ALICE.peer_id and rec.content["layers"] == [0, 10] and rec.seq == 1


def test_bad_signature():
    fields = msgpack.unpackb(signed(), raw=False)
    fields[1] = canonical(report(layers=[0, 30]))  # change the content, keep the signature
    assert rejected(msgpack.packb(fields, use_bin_type=True)) is Reject.BAD_SIGNATURE
    fields = msgpack.unpackb(signed(), raw=False)
    fields[6] = bytes(64)
    assert rejected(msgpack.packb(fields, use_bin_type=True)) is Reject.BAD_SIGNATURE


def test_signer_that_does_not_match_the_claimed_peer():
    # Mallory signs a report that claims to be Alice's
    assert rejected(signed(MALLORY, report(ALICE))) is Reject.SIGNER_MISMATCH
    # ...or re-signs Alice's content as herself
    fields = msgpack.unpackb(signed(), raw=False)
    fields[5] = MALLORY.peer_id.multihash
    head = msgpack.packb(fields[:6], use_bin_type=True)
    fields[6] = MALLORY.sign(DOMAIN + head)
    assert rejected(msgpack.packb(fields, use_bin_type=True)) is Reject.SIGNER_MISMATCH


def test_expired_and_from_the_future():
    assert rejected(signed(now=NOW - 120_000, ttl=60_000)) is Reject.EXPIRED
    assert rejected(signed(now=NOW + 3_600_000)) is Reject.FROM_FUTURE
    # small clock skew is tolerated
    RecordVerifier(TYPES).verify(signed(now=NOW + 5_000), NOW)


def test_replayed_or_older_sequence_numbers():
    v = RecordVerifier(TYPES)
    v.verify(signed(seq=5), NOW)
    assert rejected(signed(seq=5), verifier=v) is Reject.REPLAYED
    assert rejected(signed(seq=4), verifier=v) is Reject.REPLAYED
    v.verify(signed(seq=6), NOW)
    # ordering is per signer and per replay key (another model is another sequence)
    v.verify(signed(content=report(model="other"), seq=1), NOW)
    v.verify(signed(MALLORY, seq=1), NOW)


def test_oversized():
    assert rejected(b"\x90" * (MAX_RECORD_BYTES + 1)) is Reject.OVERSIZED
    assert rejected(signed(content=report(pad="x" * 3000))) is Reject.OVERSIZED


def test_unknown_type():
    assert rejected(signed(ptype="meshnet/other/v9")) is Reject.UNKNOWN_TYPE


@pytest.mark.parametrize(
    "wire",
    [
        b"\xc1",  # never-used msgpack byte
        b"\x93\x01\x02\x03",  # an array of the wrong length
        msgpack.packb(["t", "not-bytes", 1, 1, 2, b"x", b"y" * 64]),
        msgpack.packb([CAP, b"p", -1, 1, 2, b"x", b"y" * 64], use_bin_type=True),
        msgpack.packb([CAP, b"p", 1, 1, 2, b"not-a-peer", b"y" * 64], use_bin_type=True),
        b"\xd4\x01\x00",  # an extension type
    ],
)
def test_malformed_msgpack_and_envelopes(wire):
    assert rejected(wire) is Reject.MALFORMED


def test_non_canonical_payload_is_malformed():
    content = report()
    unsorted = {"model": content["model"], "peer_id": content["peer_id"], "layers": content["layers"]}
    payload = msgpack.packb(unsorted, use_bin_type=True)
    assert payload != canonical(content)
    head = [CAP, payload, 1, NOW, NOW + 1000, ALICE.peer_id.multihash]
    wire = msgpack.packb(head + [ALICE.sign(DOMAIN + msgpack.packb(head, use_bin_type=True))], use_bin_type=True)
    assert rejected(wire) is Reject.MALFORMED


@given(st.binary(max_size=300))
def test_fuzz_random_envelopes_only_raise_rejections(data):
    try:
        RecordVerifier(TYPES).verify(data, NOW)
    except RecordRejected:
        pass


@given(st.data())
def test_fuzz_mutated_records_never_verify(data):
    wire = bytearray(signed())
    i = data.draw(st.integers(0, len(wire) - 1))
    wire[i] ^= data.draw(st.integers(1, 255))
    try:
        rec = RecordVerifier(TYPES).verify(bytes(wire), NOW)
    except RecordRejected:
        return
    # a flipped byte can only survive where it changes nothing signed (msgpack framing
    # aliases), and then the content must be exactly the original
    assert rec.content == report() and rec.signer == ALICE.peer_id


# What ``seal`` writes is exactly the array of the head and its signature packed whole
# (it reuses the head's packed bytes instead of packing them twice), for heads of any
# length, short (a fixarray) or not.
_VALUES = st.one_of(st.integers(-2**63, 2**64 - 1), st.binary(max_size=80), st.text(max_size=20), st.none(),
                    st.booleans(), st.lists(st.integers(0, 300), max_size=20),
                    st.dictionaries(st.text(max_size=5), st.integers(-2**63, 2**63 - 1), max_size=5))


@given(st.lists(_VALUES, max_size=17))
def test_a_sealed_head_is_the_head_and_its_signature_packed_whole(head):
    from meshnet_p2p.core.records import head_verifies, seal

    wire = seal(ALICE, b"test", head)
    signature = ALICE.sign(b"test" + msgpack.packb(head, use_bin_type=True))
    assert wire == msgpack.packb(head + [signature], use_bin_type=True)
    fields = msgpack.unpackb(wire, raw=False, strict_map_key=False)
    assert head_verifies(ALICE.peer_id, fields[-1], b"test", fields[:-1], sealed=wire)
    assert not head_verifies(MALLORY.peer_id, fields[-1], b"test", fields[:-1], sealed=wire)


@given(st.data())
def test_a_sealed_head_read_off_its_bytes_verifies_only_as_signed(data):
    """Checked off the sealed bytes, a head verifies only for its signer and exactly
    the bytes signed: a flipped byte anywhere fails, or (msgpack framing aliases)
    unpacks to the same values and is checked packed again as before."""
    from meshnet_p2p.core.records import head_verifies, seal

    head = data.draw(st.lists(_VALUES, min_size=1, max_size=8))
    wire = bytearray(seal(ALICE, b"test", head))
    i = data.draw(st.integers(0, len(wire) - 1))
    wire[i] ^= data.draw(st.integers(1, 255))
    try:
        fields = msgpack.unpackb(bytes(wire), raw=False, strict_map_key=False)
    except Exception:
        return
    if not (isinstance(fields, list) and fields and isinstance(fields[-1], bytes) and len(fields[-1]) == 64):
        return
    if head_verifies(ALICE.peer_id, fields[-1], b"test", fields[:-1], sealed=bytes(wire)):
        assert fields[:-1] == head


def test_a_head_its_signer_packed_otherwise_is_checked_as_it_was_signed():
    """A signer that packs its head another way (an int in 9 bytes, not 1) signs those
    bytes: read off the sealed bytes, that is what is checked, and the values are its."""
    from meshnet_p2p.core.records import head_verifies

    head_bytes = b"\x92" + b"\xcf" + (5).to_bytes(8, "big") + b"\xa1x"  # [5, "x"], the 5 as uint64
    signature = ALICE.sign(b"test" + head_bytes)
    wire = b"\x93" + head_bytes[1:] + b"\xc4\x40" + signature
    fields = msgpack.unpackb(wire, raw=False)
    assert fields == [5, "x", signature]
    assert head_verifies(ALICE.peer_id, signature, b"test", fields[:-1], sealed=wire)
    assert not head_verifies(ALICE.peer_id, signature, b"test", fields[:-1])  # packed again: other bytes


def _non_canonical():
    """A record whose payload is signed but not canonical (its map keys unsorted)."""
    content = report()
    payload = msgpack.packb({"model": content["model"], "peer_id": content["peer_id"], "layers": content["layers"]},
                           use_bin_type=True)
    head = [CAP, payload, 1, NOW, NOW + 1000, ALICE.peer_id.multihash]
    return msgpack.packb(head + [ALICE.sign(DOMAIN + msgpack.packb(head, use_bin_type=True))], use_bin_type=True)


def _outcome(wire, **kw):
    try:
        r = RecordVerifier(TYPES).verify(wire, NOW, **kw)
        return ("ok", r.content, r.seq, r.signer)
    except RecordRejected as e:
        return ("rejected", e.reason)


@given(st.data())
def test_a_record_checked_from_what_peek_unpacked_fares_as_one_unpacked_again(data):
    """Gossip peeks at a record (is it new here?) before checking it, and the check
    reuses what the peek unpacked: for any bytes, the same record or the same reason."""
    from meshnet_p2p.core.records import peek_unpacked

    wire = bytearray(data.draw(st.sampled_from([signed(), signed(MALLORY), signed(ttl=-5), signed(content={"x": 1}),
                                                _non_canonical()])))
    for _ in range(data.draw(st.integers(0, 3))):
        i = data.draw(st.integers(0, len(wire) - 1))
        wire[i] ^= data.draw(st.integers(0, 255))
    wire = bytes(wire)
    peeked = peek_unpacked(wire)
    if peeked is not None:
        assert _outcome(wire, unpacked=peeked[1:]) == _outcome(wire)
