"""Property tests of every decoder that reads network input (issue 11).

Each decoder is fed arbitrary input and mutations of valid input; the only
exception that may escape is the decoder's own typed error, nothing may hang,
and what it accepts must be well formed. Already covered elsewhere, and not
repeated here: the HTTP/2 transport (test_h2.py), GGUF headers
(test_gguf_cut.py), the capability, evidence and index validators called
directly (test_capability.py, test_certification.py), peer ID text
(test_identity.py), random bundles from a few field values (test_wire_fuzz.py).
fuzz/atheris_decoders.py explores the same decoders from raw bytes, guided by
coverage (CI runs it bounded).

The bugs these tests found (an unhashable datagram kind that killed a node,
a tensor shape whose rank cost quadratic time, control characters in
multiaddrs, a certificate whose mangled key type or version escaped as
cryptography's own exceptions) are fixed; their tests stay as regressions.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import pathlib
import time
import tracemalloc
from unittest import mock

import msgpack
import pytest
import trio
import trio.testing
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from meshnet_p2p._proto import shard_runtime_pb2 as pb
from meshnet_p2p.swarm.capability import CAPABILITY, MODEL_INDEX, MODELS_KEY
from meshnet_p2p.trust.attestation import TOKENS_DOMAIN, Attestation, ids_digest
from meshnet_p2p.trust.catalogue import CATALOGUE, catalogue_key
from meshnet_p2p.trust.commitment import Commitment, CommitmentError
from meshnet_p2p.trust.evidence import (
    CERTIFICATE,
    CERT_INDEX,
    WHOLE_MODEL,
    Evidence,
    RouteRun,
    expected_digests,
    index_key,
)
from meshnet_p2p.nat import relay as relay_mod
from meshnet_p2p.nat.relay import (
    PEER_DOMAIN,
    RELAY_DOMAIN,
    Relay,
    RelayError,
    RelayLimits,
)
from meshnet_p2p.dataplane.transport.connect import relay_target
from meshnet_p2p.dataplane.servicer import Limits, ShardRuntimeServicer
from meshnet_p2p.dataplane.wire import (
    MAX_FRAGMENTS,
    PayloadError,
    bundle_from_proto,
    bundle_to_proto,
    commitment_from_proto,
    crc32c,
)
from meshnet_p2p.dht import wire
from meshnet_p2p.dht.gossip import GossipState
from meshnet_p2p.dht.node import DHTNode
from meshnet_p2p.engine.contract import (
    HIDDEN,
    OK,
    EngineCapabilities,
    HealthResult,
    LoadResult,
    MetricsResult,
    ShardEngine,
    Status,
    StatusCode,
    StepResult,
    Tensor,
    TensorBundle,
    TokenOutput,
)
from meshnet_p2p.engine.recipe import recipe_digest
from meshnet_p2p.engine.seam import seam_itemsize
from meshnet_p2p.core.identity import Identity, PeerId
from meshnet_p2p.core.multiaddr import Multiaddr, MultiaddrError
from meshnet_p2p.swarm.node import TYPES
from meshnet_p2p.core.records import DOMAIN as RECORD_DOMAIN
from meshnet_p2p.core.records import (
    RecordRejected,
    RecordVerifier,
    canonical,
    peek,
    seal,
    sign_record,
)
from meshnet_p2p.swarm.relay_offers import RELAY, RELAYS_KEY
from meshnet_p2p.trust.verdicts import FRAUD_REPORT, PEER_VERDICTS, report_key, verdicts_key
from meshnet_p2p.testing import FakeNetwork, sample_report

from tests.mutations import mutate_bytes, mutate_tree

NOW = 1_700_000_000_000  # a fixed wall clock (ms): every example replays exactly
ALICE = Identity.from_seed(b"\x31" * 32)  # sends datagrams, signs capability reports and model index entries
BOB = Identity.from_seed(b"\x32" * 32)  # receives datagrams
CERTIFIER = Identity.from_seed(b"\x09" * 32)
STRANGER = Identity.from_seed(b"\x33" * 32)
PEERS = [Identity.from_seed(bytes([i]) * 32) for i in range(1, 4)]

VECTORS = json.loads((pathlib.Path(__file__).parent / "data" / "recipe_vectors.json").read_text())["recipes"]
AXES = VECTORS[0]["axes"]
MODEL, RECIPE = "ab" * 32, recipe_digest(AXES)

# --- values msgpack can carry ---------------------------------------------------------------

mp_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
                       st.text(max_size=24), st.binary(max_size=48))
# what the network decoders see: msgpack maps may have str or bin keys
mp_values = st.recursive(mp_scalars, lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.dictionaries(st.one_of(st.text(max_size=8), st.binary(max_size=8)), kids, max_size=4)),
    max_leaves=10)
# what a signer can put in a record (canonical(): str keys only)
plausible = st.one_of(
    st.sampled_from([MODEL, RECIPE, "00" * 32, "AB" * 32, "", "x", str(ALICE.peer_id), str(CERTIFIER.peer_id),
                     str(PEERS[0].peer_id), "whole-model", "two-routes", "models", f"model/{MODEL}", 0, 1, 2, 3, 10,
                     20, 30, -1, 2**32, 2**63, True, False, None, [], {}, b"\0" * 64, 1.5, float("nan")]),
    st.integers(-5, 40),
)
record_values = st.one_of(plausible, st.recursive(mp_scalars, lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=8), kids, max_size=4)), max_leaves=8))


# --- DHT datagrams (meshnet_p2p/dht/wire.py) ----------------------------------------------------

body_st = st.dictionaries(st.text(max_size=8), mp_values, max_size=5)


@given(st.data(), st.sampled_from(sorted(wire.KINDS)), body_st, st.booleans())
def test_mutated_valid_datagrams_decode_or_raise_bad_datagram(data, kind, body, addressed):
    valid = wire.encode(ALICE, kind, b"abcdefgh", body, NOW, to=BOB.peer_id if addressed else None)
    same = msgpack.packb(wire.decode(valid, NOW, BOB.peer_id).body, use_bin_type=True)
    assert same == msgpack.packb(body, use_bin_type=True)  # (bytes, not ==: a NaN is not equal to itself)
    damaged = mutate_bytes(data, valid)
    try:
        msg = wire.decode(damaged, NOW, BOB.peer_id)
    except wire.BadDatagram:
        return
    # only an edit of nothing signed survives (msgpack framing aliases): the same message
    assert (msg.kind, msg.rpc_id, msg.sender, msg.sent_ms) == (kind, b"abcdefgh", ALICE.peer_id, NOW)


_DATAGRAM_FIELDS = ["version", "kind", "rpc_id", "sender", "to", "sent_ms", "body", "signature"]
_DATAGRAM_JUNK = {
    "version": st.sampled_from(["mdht1", "MDHT2", b"mdht2", ""]) | mp_values,
    "kind": st.sampled_from(sorted(wire.KINDS)) | mp_values,
    "rpc_id": st.binary(max_size=12) | mp_values,
    "sender": st.sampled_from([BOB.peer_id.multihash, ALICE.peer_id.multihash[:-1], b"\0\x24" + b"\0" * 36,
                               b"\x12\x20" + b"\0" * 32]) | mp_values,
    "to": st.sampled_from([STRANGER.peer_id.multihash, b"\0"]) | mp_values,
    "sent_ms": st.sampled_from([NOW - 60_001, NOW + 60_001, 0, -1, 2**64 - 1, True, 1.0 * NOW]) | mp_values,
    "body": mp_values,
    "signature": st.binary(max_size=70) | mp_values,
}


@given(st.data(), st.sets(st.sampled_from(_DATAGRAM_FIELDS), max_size=3), st.sampled_from(sorted(wire.KINDS)),
       body_st, st.sampled_from([b"", BOB.peer_id.multihash]), st.integers(NOW - 60_000, NOW + 60_000), st.booleans(),
       st.sampled_from([None, BOB.peer_id]))
def test_datagrams_with_fields_replaced_decode_or_raise_bad_datagram(data, junk, kind, body, to, sent_ms, sealed, me):
    """A valid datagram with up to three fields replaced by junk, signed over the
    junk (a sender may sign what it likes) or not."""
    fields = {"version": wire.VERSION, "kind": kind, "rpc_id": b"abcdefgh", "sender": ALICE.peer_id.multihash,
              "to": to, "sent_ms": sent_ms, "body": body}
    for name in junk - {"signature"}:
        fields[name] = data.draw(_DATAGRAM_JUNK[name], label=name)
    head = [fields[name] for name in _DATAGRAM_FIELDS[:7]]
    if "signature" in junk:
        datagram = msgpack.packb(head + [data.draw(_DATAGRAM_JUNK["signature"], label="signature")], use_bin_type=True)
    elif sealed:
        datagram = seal(ALICE, wire.DOMAIN, head)
    else:
        datagram = msgpack.packb(head + [bytes(64)], use_bin_type=True)
    try:
        msg = wire.decode(datagram, NOW, me)
    except wire.BadDatagram:
        return
    assert isinstance(msg.kind, str) and 0 < len(msg.kind) <= wire.MAX_KIND_CHARS
    assert isinstance(msg.rpc_id, bytes) and len(msg.rpc_id) == 8
    assert isinstance(msg.body, dict) and abs(msg.sent_ms - NOW) <= wire.MAX_CLOCK_SKEW_MS
    assert msg.sender == ALICE.peer_id and sealed and "signature" not in junk
    assert fields["to"] == b"" or me is None or fields["to"] == me.multihash


@given(mp_values)
def test_any_msgpack_value_decodes_or_raises_bad_datagram(value):
    try:
        wire.decode(msgpack.packb(value, use_bin_type=True), NOW)
    except wire.BadDatagram:
        pass


unhashable = st.one_of(st.lists(mp_scalars, max_size=3), st.dictionaries(st.text(max_size=4), mp_scalars, max_size=3))


@given(unhashable)
@example([])
def test_a_datagram_whose_kind_is_a_list_or_map_is_a_bad_datagram(kind):
    datagram = msgpack.packb([wire.VERSION, kind, b"abcdefgh", b"", b"", NOW, {}, b"\0" * 64], use_bin_type=True)
    with pytest.raises(wire.BadDatagram):
        wire.decode(datagram, NOW)


def test_a_node_keeps_serving_after_a_datagram_with_a_list_kind():
    async def main():
        network = FakeNetwork()
        node = DHTNode(BOB, network.endpoint(), TYPES, now_ms=lambda: NOW)
        attacker = network.endpoint()
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            await attacker.send(msgpack.packb([wire.VERSION, [], 0, 0, 0, 0, 0, 0]), node.addr)
            await trio.sleep(1)
            await attacker.send(wire.encode(ALICE, "ping", b"12345678", {}, NOW), node.addr)
            with trio.fail_after(5):
                while True:  # (the node may also ping back, to verify the new contact)
                    data, _ = await attacker.receive()
                    if wire.decode(data, NOW).kind in ("pong", "cookie"):
                        break
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


contact_items = st.one_of(
    st.tuples(st.sampled_from([ALICE.peer_id.multihash, BOB.peer_id.multihash, b"\0\x01x"]) | st.binary(max_size=40),
              st.one_of(st.sampled_from(["127.0.0.1", "", "x" * 256]), st.text(max_size=20)),
              st.one_of(st.integers(-1, 70_000), mp_scalars)).map(list),
    mp_values,
)


@given(st.one_of(st.lists(contact_items, max_size=12), mp_values), st.integers(0, 16))
def test_contact_lists_decode_or_raise_bad_datagram(raw, limit):
    try:
        contacts = wire.decode_contacts(raw, limit)
    except wire.BadDatagram:
        return
    assert len(contacts) <= limit
    for peer, host, port in contacts:
        assert isinstance(peer, PeerId) and isinstance(host, str) and len(host) <= 255 and 0 < port < 65536


@given(mp_values)
def test_gossip_digests_of_any_shape_parse_to_a_bounded_digest(raw):
    have = GossipState.parse_digest(raw)
    assert len(have) <= 1024
    for topic, seqs in have.items():
        assert isinstance(topic, str) and all(isinstance(s, bytes) and isinstance(q, int) for s, q in seqs.items())


@given(st.one_of(st.binary(max_size=200), mp_values.map(lambda v: msgpack.packb(v, use_bin_type=True)),
                 st.lists(mp_values, min_size=7, max_size=7).map(lambda v: msgpack.packb(v, use_bin_type=True))))
def test_peek_never_raises(wire_bytes):
    head = peek(wire_bytes)
    assert head is None or len(head) == 3


# --- signed records of every payload type (meshnet_p2p/records.py, network.TYPES) ----------------


def _route() -> RouteRun:
    """A route whose hops chain (as tests/test_certification.py builds one)."""
    steps = [(0, 3, 21), (3, 1, 22), (4, 1, 23)]
    run = RouteRun(list(steps), [21, 22, 23], [], "s1")
    head_in, tail_out = expected_digests((11, 12, 13), run)
    seams = [head_in, "01" * 32, "02" * 32, tail_out]
    for i, (ident, (a, b)) in enumerate(zip(PEERS, ((0, 10), (10, 20), (20, 30)))):
        att = Attestation(str(ident.peer_id), f"s1-{i}", MODEL, RECIPE, a, b, len(steps), seams[i], seams[i + 1])
        run.hops.append(att.signed_by(ident))
    return run


def _contents() -> dict[str, tuple[Identity, dict]]:
    from tests.test_audit import proof as fraud_proof  # a real transferable proof, signed chain and all

    proof = fraud_proof()
    report = sample_report(ALICE, MODEL, RECIPE)
    with_recipe = dataclasses.replace(report, recipe=AXES, recipe_labels={"recipe_name": "default"})
    evidence = Evidence(MODEL, RECIPE, 30, WHOLE_MODEL, (11, 12, 13), (_route(),), ids_digest(TOKENS_DOMAIN, [21, 22, 23]),
                        AXES, {"recipe_name": "default"})
    return {
        CAPABILITY: (ALICE, report.content(ALICE)),
        CAPABILITY + "+recipe": (ALICE, with_recipe.content(ALICE)),
        MODEL_INDEX: (ALICE, {"key": MODELS_KEY, "peer_id": str(ALICE.peer_id), "model_digest": MODEL, "name": "m",
                              "n_layer": 30}),
        CERTIFICATE: (CERTIFIER, evidence.content(CERTIFIER.peer_id)),
        CERT_INDEX: (CERTIFIER, {"key": index_key(MODEL, str(CERTIFIER.peer_id)), "certifier": str(CERTIFIER.peer_id),
                                 "model_digest": MODEL, "recipes": [RECIPE]}),
        FRAUD_REPORT: (ALICE, {"key": report_key(proof.model_digest, proof.peer_id), "reporter": str(ALICE.peer_id),
                               "proof": proof.to_content()}),
        PEER_VERDICTS: (CERTIFIER, {"key": verdicts_key(MODEL, str(CERTIFIER.peer_id)),
                                    "certifier": str(CERTIFIER.peer_id), "model_digest": MODEL,
                                    "verified": [[str(PEERS[0].peer_id), 3]],
                                    "convicted": [[str(PEERS[1].peer_id), "a fraud report, re-checked by replay"]]}),
        CATALOGUE: (CERTIFIER, {"key": catalogue_key(str(CERTIFIER.peer_id)), "certifier": str(CERTIFIER.peer_id),
                                "entries": [{"name": "SmolLM2-135M-Instruct", "model_digest": MODEL,
                                             "manifest_digest": "ab" * 32, "file_size": 101_000_000}]}),
        RELAY: (ALICE, {"key": RELAYS_KEY, "peer_id": str(ALICE.peer_id),
                        "addr": f"/ip4/10.0.0.1/tcp/4002/p2p/{ALICE.peer_id}",
                        "limits": {"max_reservations": 128, "max_connections_per_peer": 16,
                                   "bytes_per_second_per_peer": 64_000_000},
                        "load": {"reservations_now": 3, "circuits_now": 2, "reservations": 9, "refused": 1, "spliced": 40,
                                 "bytes": 123_456, "expired": 0}, "version": "0.1.0"}),
    }


CONTENTS = _contents()
VALID = {name: sign_record(ident, name.split("+")[0], content, seq=5, now_ms=NOW, ttl_ms=60_000)
         for name, (ident, content) in CONTENTS.items()}


def test_every_payload_type_has_a_valid_record_here():
    assert {name.split("+")[0] for name in CONTENTS} == set(TYPES)
    for name, record in VALID.items():
        assert RecordVerifier(TYPES).verify(record, NOW).content == CONTENTS[name][1]


@given(st.data(), st.sampled_from(sorted(VALID)))
def test_mutated_records_of_every_type_are_rejected_or_unchanged(data, name):
    damaged = mutate_bytes(data, VALID[name])
    try:
        rec = RecordVerifier(TYPES).verify(damaged, NOW)
    except RecordRejected:
        return
    assert rec.content == CONTENTS[name][1] and rec.signer == CONTENTS[name][0].peer_id


@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data(), st.sampled_from(sorted(CONTENTS) + [CERTIFICATE] * 3))  # evidence has the most to get wrong
def test_re_signed_edits_of_every_type_are_accepted_only_if_valid(data, name):
    """A signer can sign any content: the verifier (and each type's validator
    inside it) must refuse bad content with RecordRejected, never an exception."""
    ident, content = CONTENTS[name]
    own = data.draw(st.integers(0, 5), label="other type or signer") > 0  # mostly its own type and signer
    ptype = name.split("+")[0] if own else data.draw(st.sampled_from(sorted(TYPES)))
    signer = ident if own else data.draw(st.sampled_from([ident, STRANGER]))
    edited = mutate_tree(data, content, data.draw(st.integers(0, 3), label="edits"), record_values)
    try:
        record = sign_record(signer, ptype, edited, seq=data.draw(st.integers(0, 2**63 - 1)), now_ms=NOW,
                             ttl_ms=60_000 if own else data.draw(st.sampled_from([60_000, 1, 25 * 3600 * 1000])))
    except TypeError:  # not a map: sign it raw, as a hostile signer would
        record = seal(signer, RECORD_DOMAIN, [ptype, msgpack.packb(edited, use_bin_type=True), 1, NOW, NOW + 60_000,
                                             signer.peer_id.multihash])
    try:
        rec = RecordVerifier(TYPES).verify(record, NOW)
    except RecordRejected:
        return
    kind = TYPES[ptype]
    assert kind.validate is None or kind.validate(rec.content) is None
    assert kind.claimed_peer_field is None or rec.content[kind.claimed_peer_field] == str(rec.signer)


@given(
    st.one_of(st.sampled_from(sorted(TYPES)), mp_values),
    st.one_of(st.sampled_from([canonical(c) for _, c in CONTENTS.values()]),
              mp_values.map(lambda v: msgpack.packb(v, use_bin_type=True)), mp_values),
    st.one_of(st.integers(0, 10), mp_values), st.one_of(st.integers(NOW - 10, NOW + 40_000), mp_values),
    st.one_of(st.integers(NOW - 10, NOW + 10**9), mp_values),
    st.one_of(st.sampled_from([ALICE.peer_id.multihash, CERTIFIER.peer_id.multihash]), mp_values),
)
def test_sealed_envelopes_of_any_fields_are_rejected_or_well_formed(ptype, payload, seq, issued, expires, signer):
    record = seal(ALICE, RECORD_DOMAIN, [ptype, payload, seq, issued, expires, signer])
    try:
        rec = RecordVerifier(TYPES).verify(record, NOW)
    except RecordRejected:
        return
    assert rec.payload_type in TYPES and rec.signer == ALICE.peer_id and isinstance(rec.content, dict)


_REQUEST_FIELDS = ["target", "key", "after", "upto", "record", "records", "have", "cookie", "client"]
_KEYS = [f"model/{MODEL}", MODELS_KEY, index_key(MODEL, str(CERTIFIER.peer_id)), "x" * 513]


@given(st.sampled_from(sorted(wire.REQUESTS)),
       st.dictionaries(st.sampled_from(_REQUEST_FIELDS) | st.text(max_size=6),
                       st.one_of(mp_values, st.sampled_from(_KEYS), st.sampled_from(sorted(VALID.values())),
                                 st.lists(st.sampled_from(sorted(VALID.values())) | st.binary(max_size=60), max_size=4),
                                 st.binary(min_size=32, max_size=32)),
                       max_size=6))
def test_a_node_answers_any_signed_request_body_or_refuses_it_with_bad_datagram(kind, body):
    """What the receive loop runs for a verified request: only BadDatagram may
    escape, and the reply must encode (the loop does not catch encode errors)."""
    node = DHTNode(BOB, FakeNetwork().endpoint(), TYPES, now_ms=lambda: NOW)
    msg = wire.decode(wire.encode(ALICE, kind, b"abcdefgh", body, NOW), NOW)

    async def handle():  # as the receive loop does: inside trio (the push path reads its clock)
        return node._handle(msg, ("10.0.0.9", 4001))

    try:
        reply_kind, reply = trio.run(handle)
    except wire.BadDatagram:
        return
    assert reply_kind in wire.RESPONSES
    wire.encode(BOB, reply_kind, msg.rpc_id, reply, NOW, to=ALICE.peer_id)


# --- tensor bundles (meshnet_p2p/dataplane/wire.py) ---------------------------------------------

u64 = st.integers(0, 2**64 - 1)
edge_u64 = st.one_of(st.integers(0, 64), st.sampled_from([2**32 - 1, 2**32, 2**63, 2**64 - 1]), u64)


@st.composite
def consistent_tensor(draw) -> pb.TensorData:
    """A tensor that tiles and checksums (so checks past the CRC are reached), then perhaps damaged."""
    dtype = draw(st.sampled_from(["f32", "f16", "bf16"]))
    shape = draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))
    data = draw(st.binary(min_size=math.prod(shape) * seam_itemsize(dtype), max_size=math.prod(shape) * seam_itemsize(dtype)))
    cuts = sorted(set(draw(st.lists(st.integers(0, len(data)), max_size=4))) | {0, len(data)})
    frags = [pb.Fragment(byte_offset=a, payload=data[a:b]) for a, b in itertools.pairwise(cuts)] or [pb.Fragment()]
    frags = draw(st.permutations(frags))
    td = pb.TensorData(name=draw(st.sampled_from([HIDDEN, "x"])), dtype=dtype, shape=shape, total_bytes=len(data),
                       fragments=frags, crc32c=crc32c(data))
    damage = draw(st.sampled_from(["none", "none", "name", "dtype", "shape", "total", "crc", "offset", "drop", "extra"]))
    if damage == "name":
        td.name = draw(st.sampled_from(["", HIDDEN, "y"]) | st.text(max_size=6))
    elif damage == "dtype":
        td.dtype = draw(st.sampled_from(["", "F32", "q4_0", "f64"]) | st.text(max_size=4))
    elif damage == "shape":
        del td.shape[:]
        td.shape.extend(draw(st.lists(edge_u64, max_size=5)))
    elif damage == "total":
        td.total_bytes = draw(edge_u64)
    elif damage == "crc":
        td.crc32c = draw(st.integers(0, 2**32 - 1))
    elif damage == "offset" and td.fragments:
        td.fragments[draw(st.integers(0, len(td.fragments) - 1))].byte_offset = draw(edge_u64)
    elif damage == "drop" and td.fragments:
        del td.fragments[draw(st.integers(0, len(td.fragments) - 1))]
    elif damage == "extra":
        td.fragments.add(byte_offset=draw(edge_u64), payload=draw(st.binary(max_size=16)))
    return td


wild_tensor = st.builds(
    lambda name, dtype, shape, total, frags, crc: pb.TensorData(name=name, dtype=dtype, shape=shape, total_bytes=total,
                                                                fragments=frags, crc32c=crc),
    st.sampled_from([HIDDEN, "", "x"]) | st.text(max_size=6), st.sampled_from(["f32", "f16", "bf16", ""]) | st.text(max_size=4),
    st.lists(edge_u64, max_size=6), edge_u64,
    st.lists(st.builds(lambda off, p: pb.Fragment(byte_offset=off, payload=p), edge_u64, st.binary(max_size=32)), max_size=5),
    st.integers(0, 2**32 - 1),
)


def _check_bundle(msg: pb.TensorBundle) -> None:
    tracemalloc.start()
    try:
        bundle = bundle_from_proto(msg)
    except PayloadError:
        bundle = None
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    # memory is bounded by what arrived, whatever total_bytes or shape declare
    assert peak <= 2 * msg.ByteSize() + (256 << 10)
    if bundle is None:
        return
    names = [t.name for t in bundle.tensors]
    assert 0 < len(names) <= 8 and len(set(names)) == len(names) and all(names)
    for t, td in zip(bundle.tensors, msg.tensors, strict=True):
        assert len(t.data) == td.total_bytes == math.prod(t.shape) * seam_itemsize(t.dtype) and crc32c(t.data) == td.crc32c
        assert all(d > 0 for d in t.shape)


@given(st.lists(st.one_of(consistent_tensor(), wild_tensor), max_size=9))
def test_bundles_near_and_far_from_valid_parse_exactly_or_raise_payload_error(tensors):
    _check_bundle(pb.TensorBundle(tensors=tensors))


@given(st.binary(max_size=600))
def test_bundles_parsed_from_any_bytes_parse_exactly_or_raise_payload_error(data):
    try:
        msg = pb.TensorBundle.FromString(data)
    except DecodeError:  # protobuf's own error: the server maps it to an error status
        return
    _check_bundle(msg)


def test_a_huge_declared_size_allocates_nothing():
    msg = pb.TensorBundle(tensors=[pb.TensorData(name=HIDDEN, dtype="f32", shape=[2**62, 2**62], total_bytes=2**64 - 1),
                                   pb.TensorData(name="x", dtype="f32", total_bytes=2**64 - 1,
                                                 fragments=[pb.Fragment(byte_offset=2**64 - 1, payload=b"x")])])
    _check_bundle(msg)
    too_many = pb.TensorBundle(tensors=[pb.TensorData(name=HIDDEN, dtype="f32", shape=[1], total_bytes=MAX_FRAGMENTS + 1,
                                                      fragments=[pb.Fragment(byte_offset=i, payload=b"x")
                                                                 for i in range(MAX_FRAGMENTS + 1)])])
    with pytest.raises(PayloadError, match="too many fragments"):
        bundle_from_proto(too_many)


def test_a_bundle_with_an_absurd_rank_is_refused_quickly():
    msg = pb.TensorBundle(tensors=[pb.TensorData(name=HIDDEN, dtype="f32", shape=[2**64 - 1] * 15_000, total_bytes=0,
                                                 crc32c=crc32c(b""))])
    assert msg.ByteSize() < 200_000  # well under one message (16 MB)
    t = time.perf_counter()
    with pytest.raises(PayloadError):
        bundle_from_proto(msg)
    assert time.perf_counter() - t < 0.25


# --- step commitments (dataplane/wire.py, trust/commitment.py; issue 26) ---------------------------
# A StepCommitment comes from a peer (a reply's commitment, a copy's upstream) or from the
# previous hop of a ring (Step.upstream); whoever reads one completes it with what it knows
# itself, and what is left may be anything a protobuf field can hold.

_digest_like = st.one_of(st.binary(min_size=32, max_size=32), st.binary(max_size=70))
_step_commitment = st.builds(
    pb.StepCommitment, index=edge_u64, input_digest=_digest_like, output_digest=_digest_like,
    signature=st.one_of(st.binary(min_size=64, max_size=64), st.binary(max_size=130)), prev=_digest_like,
    session_id=st.text(max_size=300), start=st.integers(0, 2**32 - 1), end=st.integers(0, 2**32 - 1),
    position=edge_u64, decode=st.booleans())
# what a receiver fills in itself: its own view, or (a client's route_epoch) a number a peer sent
_known = st.fixed_dictionaries({}, optional={
    "session_id": st.text(max_size=200), "start": edge_u64, "end": edge_u64, "position": edge_u64,
    "decode": st.booleans(), "prev": _digest_like})


def _complete_or_commitment_error(m: pb.StepCommitment, peer: str, epoch: int, known: dict) -> None:
    w = commitment_from_proto(m)
    try:
        c = w.complete(peer_id=peer, model_digest=MODEL, recipe_digest=RECIPE, route_epoch=epoch, **known)
    except CommitmentError:
        return
    assert len(c.input_digest) == len(c.output_digest) == len(c.prev) == 32 and len(c.signature) in (0, 64)
    assert w.names(c)
    c.link()
    assert not c.verifies()  # nobody here signed it


@given(_step_commitment, st.sampled_from([str(ALICE.peer_id), "", "not a peer", "p" * 200]), edge_u64, _known)
@example(pb.StepCommitment(index=2**64 - 1), str(ALICE.peer_id), 0, {})
@example(pb.StepCommitment(input_digest=b"\0" * 31, output_digest=b"\0" * 32, prev=b"\0" * 32), "x", 0, {})
@example(pb.StepCommitment(input_digest=b"\0" * 32, output_digest=b"\0" * 32, prev=b"\0" * 32,
                           signature=b"\0" * 64, session_id="s" * 10_000), str(ALICE.peer_id), 0, {})
def test_any_step_commitment_completes_to_a_commitment_or_raises_commitment_error(m, peer, epoch, known):
    _complete_or_commitment_error(m, peer, epoch, known)


@given(st.binary(max_size=300))
def test_step_commitments_from_any_bytes_complete_or_raise_commitment_error(data):
    try:
        m = pb.StepCommitment.FromString(data)
    except DecodeError:  # protobuf's own error: the stream maps it to an error status
        return
    _complete_or_commitment_error(m, str(ALICE.peer_id), 0, {})


@given(mp_values)
@example({f.name: None for f in dataclasses.fields(Commitment)})
def test_commitment_content_of_any_msgpack_value_parses_or_raises_commitment_error(value):
    try:
        c = Commitment.from_content(msgpack.unpackb(msgpack.packb(value, use_bin_type=True), raw=False,
                                                    strict_map_key=False))
    except CommitmentError:
        return
    c.link()


# --- the Session stream (meshnet_p2p/dataplane/servicer.py) ----------------------------------------

N_EMBD = 4


class FakeEngine(ShardEngine):
    """A unit-test double of a shard engine: checks positions, inputs and capacity
    the way the contract says, computes nothing."""

    def __init__(self, start: int, end: int, total: int = 30, max_sessions: int = 2, n_ctx: int = 64) -> None:
        self.caps = EngineCapabilities("fake", start, end, total, N_EMBD, 100 if end == total else 0, "shard",
                                       max_sessions, max_sessions * n_ctx, n_ctx, MODEL, RECIPE, AXES)
        self.sessions: dict[str, list[int]] = {}  # id -> [position, max_tokens]

    def load(self, request):
        return LoadResult(OK, self.caps)

    def capabilities(self):
        return self.caps

    def open_session(self, request):
        if request.session_id in self.sessions:
            return Status(StatusCode.SESSION_EXISTS)
        if len(self.sessions) >= self.caps.max_sessions or request.max_tokens > self.caps.n_ctx_per_session:
            return Status(StatusCode.CAPACITY_EXHAUSTED, retryable=True)
        self.sessions[request.session_id] = [0, request.max_tokens]
        return OK

    def _run(self, sid, position, tokens, hidden, decode):
        s = self.sessions.get(sid)
        if s is None:
            return StepResult(Status(StatusCode.UNKNOWN_SESSION))
        if position != s[0]:
            return StepResult(Status(StatusCode.POSITION_MISMATCH))
        if self.caps.is_head != (tokens is not None):
            return StepResult(Status(StatusCode.WRONG_INPUT))
        if tokens is not None:
            rows = len(tokens)
        else:
            t = hidden.get(HIDDEN)
            if t is None or t.dtype != "f32" or len(t.shape) != 2 or t.shape[1] != N_EMBD:
                return StepResult(Status(StatusCode.BAD_TENSOR))
            rows = t.shape[0]
        if decode and rows != 1:
            return StepResult(Status(StatusCode.INVALID_ARGUMENT))
        if position + rows > s[1]:
            return StepResult(Status(StatusCode.CONTEXT_EXHAUSTED))
        s[0] += rows
        if self.caps.is_tail:
            return StepResult(OK, s[0], token=TokenOutput(position % 7, is_eog=position % 5 == 0))
        return StepResult(OK, s[0], hidden=TensorBundle((Tensor(HIDDEN, "f32", (rows, N_EMBD), bytes(rows * N_EMBD * 4)),)))

    def prefill(self, request):
        return self._run(request.session_id, request.position, request.token_ids, request.hidden, False)

    def decode(self, request):
        tokens = None if request.token_id is None else (request.token_id,)
        return self._run(request.session_id, request.position, tokens, request.hidden, True)

    def rollback(self, session_id, position):
        s = self.sessions.get(session_id)
        if s is None:
            return Status(StatusCode.UNKNOWN_SESSION)
        if position > s[0]:
            return Status(StatusCode.POSITION_MISMATCH)
        s[0] = position
        return OK

    def cancel(self, session_id, *, keep_session=False):
        if not keep_session:
            self.sessions.pop(session_id, None)
        return OK

    def release(self, session_id):
        self.sessions.pop(session_id, None)
        return OK

    def health(self):
        return HealthResult(True, "serving", len(self.sessions))

    def metrics(self):
        return MetricsResult(active_sessions=len(self.sessions))


ROLES = {"head": (0, 10), "middle": (10, 20), "tail": (20, 30), "whole": (0, 30)}
small = st.one_of(st.integers(0, 6), edge_u64)
small32 = st.one_of(st.integers(0, 6), st.integers(0, 2**32 - 1))
session_ids = st.one_of(st.sampled_from(["s1", "s2"]), st.text(max_size=10))


def _hidden(rows, fragment_bytes):
    data = bytes(range(256)) * (rows * N_EMBD * 4 // 256 + 1)
    return bundle_to_proto(TensorBundle((Tensor(HIDDEN, "f32", (rows, N_EMBD), data[:rows * N_EMBD * 4]),)), fragment_bytes)


hidden_st = st.one_of(st.builds(_hidden, st.integers(1, 4), st.integers(1, 64)),
                      st.lists(st.one_of(consistent_tensor(), wild_tensor), max_size=3).map(lambda ts: pb.TensorBundle(tensors=ts)))


def _open(sid, epoch, fingerprint, credits, temperature, top_k, top_p, seed, max_tokens, attach_token=b"t" * 32):
    return pb.SessionRequest(open=pb.SessionOpen(
        session_id=sid, route_epoch=epoch, fingerprint=fingerprint, proposed=pb.FlowControl(credits=credits),
        sampling=pb.Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed), max_tokens=max_tokens,
        attach_token=attach_token))


FINGERPRINT = pb.Fingerprint(model_digest=MODEL, recipe_digest=RECIPE, recipe_axes={k: str(v) for k, v in AXES.items()})
fingerprints = st.one_of(
    st.just(FINGERPRINT),
    st.builds(lambda m, r, axes: pb.Fingerprint(model_digest=m, recipe_digest=r, recipe_axes=axes),
              st.sampled_from([MODEL, ""]) | st.text(max_size=8), st.sampled_from([RECIPE, ""]) | st.text(max_size=8),
              st.dictionaries(st.sampled_from(sorted(AXES)) | st.text(max_size=6), st.text(max_size=6), max_size=3)),
)
floats32 = st.one_of(st.sampled_from([0.0, 0.7, 1.0]), st.floats(width=32))
open_st = st.builds(_open, session_ids, small, fingerprints, small32, floats32, small32, floats32, small,
                    st.one_of(st.integers(0, 80), st.integers(0, 2**32 - 1)), st.binary(max_size=40))
valid_open = st.builds(_open, st.just("s1"), st.integers(0, 2), st.just(FINGERPRINT),
                       st.integers(0, 3), st.just(0.0), st.just(0), st.just(0.0), st.just(0), st.integers(1, 64))


def _step(work_id, n, epoch, position, decode, tokens, hidden, deadline):
    step = pb.Step(work_id=work_id, idempotency_step=n, route_epoch=epoch, position=position, decode=decode,
                   token_ids=tokens, deadline_unix_ms=deadline)
    if hidden is not None:
        step.hidden.CopyFrom(hidden)
    return pb.SessionRequest(step=step)


step_st = st.builds(_step, st.sampled_from(["w1", "w2", ""]) | st.text(max_size=6), small, small, small, st.booleans(),
                    st.lists(small32, max_size=6), st.none() | hidden_st,
                    st.sampled_from([0, NOW - 1, NOW + 1]) | u64)
request_st = st.one_of(
    step_st, step_st, step_st, open_st,
    st.builds(lambda c: pb.SessionRequest(credit=pb.CreditTopUp(credits=c)), small32),
    st.builds(lambda w, r: pb.SessionRequest(cancel=pb.CancelSignal(work_id=w, reason=r)),
              st.sampled_from(["w1", "w2", ""]) | st.text(max_size=6), st.text(max_size=10)),
    st.builds(lambda p, e: pb.SessionRequest(rollback=pb.RollbackSignal(position=p, route_epoch=e)), small, small),
    st.just(pb.SessionRequest(release=pb.ReleaseSignal())),
    st.just(pb.SessionRequest(attest=pb.AttestSignal())),
    # the ring's messages: a link never dials here (no push sink: the host serves no ring), an attach
    # names any session with any token
    st.builds(lambda e, peer, report, sid, tok, until: pb.SessionRequest(link=pb.LinkSignal(
        route_epoch=e, peer_id=peer, next_report=report, session_id=sid, attach_token=tok,
        forward_until=until)), small, st.text(max_size=8), st.binary(max_size=24),
        session_ids, st.binary(max_size=40), small),
    st.builds(lambda sid, tok, e: pb.SessionRequest(attach=pb.AttachOpen(session_id=sid, attach_token=tok,
                                                                         route_epoch=e)),
              st.sampled_from(["s1", ""]) | session_ids, st.sampled_from([b"", b"t" * 32]) | st.binary(max_size=40),
              small),
    st.just(pb.SessionRequest()),
)


@st.composite
def honest_then_damaged(draw, role: str) -> list[pb.SessionRequest]:
    """A session a correct client would send (a prefill, decodes, top-ups, maybe an
    attest, a rollback and a release), then up to three requests inserted,
    replaced, dropped or repeated: so steps reach the engine, and then go wrong."""
    head = ROLES[role][0] == 0
    reqs = [_open("s1", 1, FINGERPRINT, draw(st.integers(1, 3)), 0.0, 0, 0.0, 0, 64)]
    pos = 0
    for n in range(1, draw(st.integers(0, 6)) + 1):
        rows = 1 if pos else draw(st.integers(1, 4))
        tokens = draw(st.lists(st.integers(0, 2**32 - 1), min_size=rows, max_size=rows)) if head else []
        hidden = None if head else _hidden(rows, draw(st.integers(1, 64)))
        reqs.append(_step(f"w{n}", n, 1, pos, pos > 0, tokens, hidden, draw(st.sampled_from([0, NOW + 1]))))
        pos += rows
        if n % 2 == 0:
            reqs.append(pb.SessionRequest(credit=pb.CreditTopUp(credits=2)))
    for extra in [pb.SessionRequest(attest=pb.AttestSignal()),
                  pb.SessionRequest(rollback=pb.RollbackSignal(position=max(pos - 1, 0), route_epoch=1)),
                  pb.SessionRequest(attest=pb.AttestSignal()), pb.SessionRequest(release=pb.ReleaseSignal())]:
        if draw(st.booleans()):
            reqs.append(extra)
    for _ in range(draw(st.integers(0, 3))):
        i = draw(st.integers(0, len(reqs)))
        op = draw(st.sampled_from(["insert", "replace", "drop", "repeat"]))
        if op == "insert" or i == len(reqs):
            reqs.insert(i, draw(request_st))
        elif op == "replace":
            reqs[i] = draw(request_st)
        elif op == "drop":
            del reqs[i]
        else:
            reqs.insert(i, reqs[i])
    return reqs


@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.booleans(), st.sampled_from(sorted(ROLES)).flatmap(lambda role: st.tuples(st.just(role), st.one_of(
    honest_then_damaged(role), st.lists(request_st, max_size=12),
    st.tuples(valid_open, st.lists(request_st, max_size=12)).map(lambda t: [t[0], *t[1]])))))
def test_any_request_sequence_gets_responses_and_frees_its_session(with_identity, role_and_requests):
    role, requests = role_and_requests
    engine = FakeEngine(*ROLES[role])
    servicer = ShardRuntimeServicer(engine, peer_id="fake-peer", identity=CERTIFIER if with_identity else None,
                                    limits=Limits(max_credits=3, max_message_bytes=2048, max_prefill_tokens=4),
                                    now_ms=lambda: NOW)
    wire_requests = [pb.SessionRequest.FromString(r.SerializeToString()) for r in requests]  # as the server decodes them
    responses = list(servicer.Session(iter(wire_requests), None))
    for i, r in enumerate(responses):
        assert isinstance(r, pb.SessionResponse) and r.WhichOneof("kind") is not None
        pb.SessionResponse.FromString(r.SerializeToString())
        if (r.HasField("error") and r.error.terminal) or r.HasField("released"):
            assert i == len(responses) - 1, "nothing follows a terminal response"
        if r.HasField("attestation"):
            assert Attestation(r.attestation.peer_id, r.attestation.session_id, MODEL, RECIPE, *ROLES[role],
                               r.attestation.steps, r.attestation.input_digest, r.attestation.output_digest,
                               r.attestation.signature).verifies()
    assert len(responses) <= len(requests)
    # the stream ended: its session is gone from the engine and the servicer alike
    assert engine.sessions == {} and servicer._states == {}


@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.sampled_from(sorted(ROLES)), st.sampled_from([b"t" * 32, b"x" * 32, b""]), st.lists(request_st, max_size=12))
def test_any_attach_stream_gets_responses_and_leaves_the_owners_session_whole(role, token, requests):
    """A stream that attaches to an open session (the ring's previous hop) and
    then sends anything: only steps (and credit) are taken, what it computes
    reaches the owner as copies, and the owner's session ends as it would."""
    engine = FakeEngine(*ROLES[role])
    servicer = ShardRuntimeServicer(engine, peer_id="fake-peer", now_ms=lambda: NOW,
                                    limits=Limits(max_credits=3, max_message_bytes=2048, max_prefill_tokens=4))
    pushed = []
    owner = servicer.Session(iter([_open("s1", 1, FINGERPRINT, 3, 0.0, 0, 0.0, 0, 64)]), None, push=pushed.append)
    assert next(owner).HasField("accepted")
    attach = pb.SessionRequest(attach=pb.AttachOpen(session_id="s1", attach_token=token, route_epoch=1))
    wire = [pb.SessionRequest.FromString(r.SerializeToString()) for r in [attach, *requests]]
    responses = list(servicer.Session(iter(wire), None))
    assert responses[0].HasField("accepted") == (token == b"t" * 32)
    for i, r in enumerate(responses):
        assert r.WhichOneof("kind") is not None
        if r.HasField("error") and r.error.terminal:
            assert i == len(responses) - 1, "nothing follows a terminal response"
    for m in pushed:  # the owner hears of its steps only: results, or why one failed
        assert m.WhichOneof("kind") in ("result", "error")
    assert "s1" in servicer._states  # an attach stream's end is not its session's
    assert list(owner) == []  # the owner goes away...
    assert engine.sessions == {} and servicer._states == {}  # ...and its session with it


# --- a ring link's fields (meshnet_p2p/dataplane/ring.py), checked before any dial ------------------

_RING_PEER = Identity.from_seed(b"\x52" * 32)


def _ring_report(layers, model: str, departing: bool, port: int) -> bytes:
    from meshnet_p2p.swarm.capability import CapabilityReport
    from meshnet_p2p.dataplane.transport.tls import make_tls_credentials

    cert = _RING_CERT.setdefault("pem", make_tls_credentials(_RING_PEER).cert_pem)
    addr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{_RING_PEER.peer_id}"
    return CapabilityReport(model, RECIPE, layers, (addr,), throughput=1.0, departing=departing,
                            tls_cert=cert.decode()).sign(_RING_PEER, seq=NOW, now_ms=NOW - 1000)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.just(str(_RING_PEER.peer_id)), st.text(max_size=60)),
       st.tuples(st.sampled_from([(20, 30), (0, 10), (20, 25)]), st.sampled_from([MODEL, "ef" * 32]), st.booleans(),
                 st.integers(1, 65535)),
       st.lists(st.tuples(st.integers(0, 1 << 12), st.integers(0, 255)), max_size=3),
       st.binary(max_size=40), st.text(max_size=140))
def test_a_ring_link_dials_only_what_a_good_report_binds(peer_id, report_args, edits, token, session_id):
    """Any report, mutated or not, and any session fields: refused with a typed
    error, or what is dialled is exactly what the report binds."""
    from meshnet_p2p.dataplane import ring

    report = _mutate(_ring_report(*report_args), edits)
    msg = pb.LinkSignal(peer_id=peer_id, next_report=report, attach_token=token, session_id=session_id)
    try:
        hop = ring.next_hop(msg, now_ms=NOW, model_digest=MODEL, recipe_digest=RECIPE, end=20, total=30)
    except (ring.LinkError, ring.ReportRefused):
        return
    layers, model, departing, port = report_args
    assert hop.peer == _RING_PEER.peer_id and str(hop.peer) == peer_id
    assert layers[0] == 20 and model == MODEL and not departing and report == _ring_report(*report_args)
    assert hop.address == ("127.0.0.1", port) and hop.relay is None and hop.cert_pem == _RING_CERT["pem"]
    assert 0 < len(token) <= 32 and 0 < len(session_id) <= 128


_RING_CERT: dict = {}


def test_the_tail_forwards_decode_tokens_until_the_generation_ends():
    from meshnet_p2p.dataplane.ring import forwards

    base = dict(is_tail=True, decode=True, new_position=10, forward_until=20, is_eog=False, stop_at_eog=True)
    assert forwards(**base)
    assert not forwards(**{**base, "decode": False})  # a prefill's token: the client sends the first decode
    assert not forwards(**{**base, "new_position": 20})  # generate() asks for no step there
    assert not forwards(**{**base, "is_eog": True}) and forwards(**{**base, "is_eog": True, "stop_at_eog": False})
    assert forwards(**{**base, "is_tail": False, "decode": False, "new_position": 99})  # the others: everything


# --- the relay's handshake (meshnet_p2p/dataplane/relay.py) ------------------------------------------
# The parsing lives inside the connection handlers (no pure parser to call), so
# these run the real handlers on in-memory streams, under a virtual clock.

RELAY_ID = Identity.from_seed(b"\x41" * 32)
LIMITS = RelayLimits(handshake_timeout=2.0, attach_timeout=2.0, max_connections_per_peer=2)


def _run(main):
    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def _drain(stream) -> bytes:
    out = bytearray()
    while True:
        try:
            chunk = await stream.receive_some(65536)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            break
        if not chunk:
            break
        out += chunk
    return bytes(out)


async def _talk(relay: Relay, chunks: list[bytes]) -> bytes:
    """Send ``chunks`` on a new connection to the relay's handler, then EOF; what it answered."""
    client, server = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(relay._handle, server)
        for chunk in chunks:
            try:
                await client.send_all(chunk)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                break
        try:
            await client.send_eof()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        answer = await _drain(client)
    return answer


def _line(words) -> bytes:
    return (" ".join(words) + "\n").encode(errors="surrogatepass")


words = st.one_of(st.sampled_from(["CONNECT", "MESHNET-RESERVE", "MESHNET-ATTACH", "HTTP/1.1", str(ALICE.peer_id),
                                   relay_target(ALICE.peer_id), "00" * 32, "zz", ":443", ".peer"]),
                  st.text(max_size=12))
first_lines = st.one_of(
    st.binary(max_size=300),
    st.lists(words, max_size=4).map(_line),
    st.tuples(st.sampled_from(["CONNECT", "MESHNET-RESERVE", "MESHNET-ATTACH"]), st.lists(words, max_size=3))
    .map(lambda t: _line([t[0], *t[1]])),
)
header_lines = st.lists(st.one_of(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"") + b"\r\n"),
                                  st.just(b"\r\n"), st.just(b"Host: x\r\n")), max_size=6)


@given(first_lines, header_lines, st.binary(max_size=64))
def test_relay_handler_survives_any_first_line_and_headers(first, headers, trailer):
    relay = Relay(RELAY_ID, LIMITS)

    async def main():
        with trio.fail_after(60):
            await _talk(relay, [first, *headers, trailer])

    _run(main)
    assert relay.reservations == {} and relay._tokens == {}


async def _reserve(stream, reader, token: str) -> None:
    """ALICE reserves on the relay over ``stream``: RESERVE, the relay's challenge, her signature, OK."""
    await stream.send_all(f"MESHNET-RESERVE {ALICE.peer_id} {token}\n".encode())
    challenge = (await reader.line()).decode().split()
    assert challenge[0] == "CHALLENGE"
    sig = ALICE.sign(PEER_DOMAIN + bytes.fromhex(challenge[1]) + RELAY_ID.peer_id.multihash)
    await stream.send_all(f"SIG {sig.hex()}\n".encode())
    assert await reader.line() == b"OK"


@given(st.booleans(), st.one_of(st.binary(max_size=200), st.lists(words, max_size=3).map(_line)))
def test_relay_reservation_handshake_with_any_reply(honest, reply):
    relay = Relay(RELAY_ID, LIMITS)

    async def main():
        client, server = trio.testing.memory_stream_pair()
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(relay._handle, server)
                reader = relay_mod._LineReader(client)
                if honest:
                    await _reserve(client, reader, "11" * 32)
                    assert len(relay.reservations) == 1
                else:
                    await client.send_all(f"MESHNET-RESERVE {ALICE.peer_id} {'11' * 32}\n".encode())
                    assert (await reader.line()).decode().split()[0] == "CHALLENGE"
                    await client.send_all(reply)
                await client.send_eof()
                await _drain(client)

    _run(main)
    assert relay.reservations == {} and relay._tokens == {}


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(
    st.one_of(st.just(f"CONNECT {relay_target(ALICE.peer_id)} HTTP/1.1\r\n".encode()),
              st.lists(words, min_size=1, max_size=3).map(lambda w: _line(["CONNECT", *w]))),
    header_lines,
    st.sampled_from(["attach", "wrong-token", "ignore"]),
    st.binary(max_size=40)), min_size=1, max_size=4))
def test_relay_connect_to_a_reserved_peer_with_any_request(clients):
    """A peer holds a reservation; clients CONNECT with any target and headers; the
    peer attaches with the right token, a wrong one, or not at all."""
    relay = Relay(RELAY_ID, LIMITS)

    async def peer_side(reader, nursery):
        while True:
            try:
                line = (await reader.line()).decode().split()
            except RelayError:
                return
            assert line[0] == "OPEN" and len(line) == 2
            behaviour = behaviours.pop(0) if behaviours else "ignore"
            if behaviour != "ignore":
                token = line[1] if behaviour == "attach" else line[1][::-1]
                nursery.start_soon(_talk, relay, [f"MESHNET-ATTACH {token}\n".encode(), b"from the peer"])

    behaviours = []

    async def main():
        control, server = trio.testing.memory_stream_pair()
        with trio.fail_after(300):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(relay._handle, server)
                reader = relay_mod._LineReader(control)
                await _reserve(control, reader, "22" * 32)
                async with trio.open_nursery() as peers:
                    peers.start_soon(peer_side, reader, peers)
                    async with trio.open_nursery() as conns:
                        for first, headers, behaviour, payload in clients:
                            behaviours.append(behaviour)
                            conns.start_soon(_talk, relay, [first, *headers, b"\r\n", payload])
                            await trio.sleep(0.01)
                    await control.send_eof()  # the peer leaves: its reservation ends (peer_side sees EOF)

    _run(main)
    assert relay.reservations == {} and relay._tokens == {}


@given(st.one_of(
    st.binary(max_size=200),
    st.lists(words, max_size=4).map(_line),
    st.tuples(st.booleans(), st.one_of(st.binary(max_size=60), st.just(b"OK\n"), st.lists(words, max_size=3).map(_line))),
))
def test_reserve_client_refuses_any_relay_answer_with_a_typed_error(script):
    """The peer's side of the handshake against a relay that answers anything;
    only what attach_to_relay catches may escape (RelayError, ValueError, broken stream)."""

    async def main():
        ours, theirs = trio.testing.memory_stream_pair()

        async def fake_relay():
            reader = relay_mod._LineReader(theirs)
            line = (await reader.line()).decode().split()
            if isinstance(script, tuple):
                honest, verdict = script
                nonce = bytes(32)
                peer_nonce = bytes.fromhex(line[2]) if honest else b"\0" * 32
                sig = RELAY_ID.sign(RELAY_DOMAIN + peer_nonce + ALICE.peer_id.multihash)
                try:
                    await theirs.send_all(f"CHALLENGE {nonce.hex()} {sig.hex()}\n".encode())
                    await reader.line()
                    await theirs.send_all(verdict)
                except (RelayError, trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
            else:
                try:
                    await theirs.send_all(script)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
            await theirs.aclose()

        async def connect(host, port):
            return ours

        with trio.fail_after(60), mock.patch.object(relay_mod.trio, "open_tcp_stream", connect):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fake_relay)
                addr = Multiaddr.parse(f"/ip4/127.0.0.1/tcp/4001/p2p/{RELAY_ID.peer_id}")
                try:
                    control, _ = await relay_mod.reserve(addr, ALICE)
                except (RelayError, ValueError, trio.BrokenResourceError):
                    return
                assert isinstance(script, tuple) and script[0] and script[1].split(b"\n")[0].rstrip(b"\r") == b"OK"
                await control.aclose()

    _run(main)


# --- multiaddrs (meshnet_p2p/multiaddr.py) ------------------------------------------------------------
# test_identity.py fuzzes a small alphabet; here: any text, and components of every protocol.


def _check_parsed(addr: Multiaddr) -> None:
    assert Multiaddr.parse(str(addr)) == addr
    port, host, transport = addr.port, addr.host, addr.transport
    assert port is None or 0 <= port <= 65535
    assert transport in (None, "tcp", "udp") and (host is None or isinstance(host, str))
    assert addr.peer_id is None or isinstance(addr.peer_id, PeerId)


@given(st.text(max_size=600))
def test_any_text_parses_to_a_multiaddr_or_raises_multiaddr_error(text):
    try:
        addr = Multiaddr.parse(text if len(text) % 2 else "/" + text)  # half of them start as a multiaddr does
    except MultiaddrError:
        return
    _check_parsed(addr)


component = st.one_of(
    st.tuples(st.sampled_from(["ip4"]), st.ip_addresses(v=4).map(str) | st.text(max_size=16)),
    st.tuples(st.sampled_from(["ip6"]), st.ip_addresses(v=6).map(str) | st.text(max_size=40)),
    st.tuples(st.sampled_from(["tcp", "udp"]), st.integers(0, 70_000).map(str) | st.text(alphabet="0123456789", max_size=6)
              | st.text(max_size=6)),
    st.tuples(st.sampled_from(["dns", "dns4", "dns6"]), st.from_regex(r"[a-z0-9-]{1,12}(\.[a-z0-9-]{1,12}){0,3}",
                                                                      fullmatch=True) | st.text(max_size=20)),
    st.tuples(st.just("p2p"), st.sampled_from([str(ALICE.peer_id), str(ALICE.peer_id)[:-1], "QmYyQSo1c1Ym7orWxLYvCrM2Em"])
              | st.text(max_size=60)),
    st.tuples(st.sampled_from(["p2p-circuit", "quic", ""]), st.just(None)),
)


@given(st.lists(component, max_size=7), st.booleans())
def test_component_sequences_parse_to_a_multiaddr_or_raise_multiaddr_error(components, trailing_slash):
    text = "".join(f"/{p}" + ("" if v is None else f"/{v}") for p, v in components) + ("/" if trailing_slash else "")
    try:
        addr = Multiaddr.parse(text)
    except MultiaddrError:
        return
    _check_parsed(addr)


@given(st.sampled_from(["/dns4/example.com\n/tcp/1", "/ip6/fe80::1%\n\x00/tcp/1", "/ip6/fe80::1%\u202e/tcp/1",
                        "/ip4/1.2.3.4/tcp/\u0661", "/ip4/1.2.3.4/tcp/\u06601"]))
@example("/dns4/example.com\n/tcp/1")
def test_a_parsed_multiaddr_is_printable_ascii(text):
    try:
        addr = Multiaddr.parse(text)
    except MultiaddrError:
        return
    assert str(addr).isascii() and str(addr).isprintable()


# --- TLS certificates: a client's (mutual TLS) and a peer's, as the network gives them ---------------


def _cert_with_extension(value: bytes, *, issuer_signed: bool) -> bytes:
    import datetime

    from cryptography import x509 as _x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from meshnet_p2p.dataplane.transport import tls

    key = ec.generate_private_key(ec.SECP256R1())
    name = _x509.Name([_x509.NameAttribute(_x509.oid.NameOID.COMMON_NAME, "fuzz")])
    now = datetime.datetime.now(datetime.timezone.utc)
    signer = tls._client_issuer()[0] if issuer_signed else key
    cert = (_x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(_x509.UnrecognizedExtension(tls.LIBP2P_TLS_OID, value), critical=False)
            .sign(signer, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.DER)


def _mutate(data: bytes, edits: list[tuple[int, int]]) -> bytes:
    out = bytearray(data)
    for pos, byte in edits:
        if out:
            out[pos % len(out)] = byte
    return bytes(out)


_REAL_EXTENSION: list[bytes] = []


def _real_extension() -> bytes:
    if not _REAL_EXTENSION:
        from cryptography import x509 as _x509

        from meshnet_p2p.dataplane.transport import tls

        cert = _x509.load_pem_x509_certificate(tls.make_client_credentials(Identity.generate()).cert_pem)
        _REAL_EXTENSION.append(cert.extensions.get_extension_for_oid(tls.LIBP2P_TLS_OID).value.value)
    return _REAL_EXTENSION[0]


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.binary(max_size=300), st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=6)),
       st.booleans())
def test_an_identity_extension_of_any_bytes_binds_nobody_or_raises_a_binding_error(value, issuer_signed):
    """The extension is attacker-chosen bytes inside a certificate whose key the
    attacker holds: whatever they are, no identity is bound but by a valid
    signature over this certificate's key (and none verifies over a fresh key)."""
    from meshnet_p2p.dataplane.transport.tls import TlsBindingError, peer_of_der

    raw = value if isinstance(value, bytes) else _mutate(_real_extension(), value)
    try:
        der = _cert_with_extension(raw, issuer_signed=issuer_signed)
    except ValueError:  # cryptography refuses to build it: nothing reaches the wire
        return
    with pytest.raises(TlsBindingError):
        peer_of_der(der)


_CLIENT = Identity.from_seed(b"\x33" * 32)
_VALID_DER: list[bytes] = []


@given(st.binary(max_size=600), st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=4))
def test_any_der_bytes_as_a_client_certificate_raise_only_a_binding_error(junk, edits):
    """Bytes as a handshake would hand them over: junk binds nobody, and a
    mutated real certificate binds its own identity or none (found: a mangled
    key type or version escaped as UnsupportedAlgorithm, InvalidVersion)."""
    import ssl as _ssl

    from meshnet_p2p.dataplane.transport.tls import TlsBindingError, make_client_credentials, peer_of_der

    if not _VALID_DER:
        _VALID_DER.append(_ssl.PEM_cert_to_DER_cert(make_client_credentials(_CLIENT).cert_pem.decode()))
    if junk:
        with pytest.raises(TlsBindingError):
            peer_of_der(junk)
    try:
        peer = peer_of_der(_mutate(_VALID_DER[0], edits))
    except TlsBindingError:
        return
    assert peer == _CLIENT.peer_id


# --- the ring's attach rules, on the servicer with a stand-in engine (review findings) -----------------

def _ring_servicer(credits: int = 3):
    engine = FakeEngine(*ROLES["middle"])
    servicer = ShardRuntimeServicer(engine, peer_id="fake-peer", now_ms=lambda: NOW,
                                    limits=Limits(max_credits=credits, max_message_bytes=4096, max_prefill_tokens=4))
    pushed: list = []
    owner = servicer.Session(iter([_open("s1", 0, FINGERPRINT, credits, 0.0, 0, 0.0, 0, 64)]), None,
                             push=pushed.append)
    assert next(owner).HasField("accepted")
    return servicer, owner, pushed


FEEDER = Identity.from_seed(b"\x0a" * 32)  # the ring's previous hop (layers 0-10), as its TLS proves it


def _fed(position: int, epoch: int = 0) -> pb.SessionRequest:
    """A step the previous hop forwards, with its signed commitment to it."""
    from meshnet_p2p.dataplane.wire import commitment_to_proto
    from meshnet_p2p.trust.commitment import Commitment, hidden_digest

    request = _step("", position + 1, epoch, position, True, [], _hidden(1, 64), 0)
    out = hidden_digest(position, bundle_from_proto(request.step.hidden))
    c = Commitment(str(FEEDER.peer_id), "f" * 32, MODEL, RECIPE, 0, 10, epoch, position, position, True,
                   bytes(32), out, bytes(32)).signed_by(FEEDER)
    commitment_to_proto(c, request.step.upstream, forwarded=True)
    return request


def _attach_stream(servicer, token: bytes, epoch: int, steps) -> list:
    from meshnet_p2p.dataplane.transport.server import Caller

    first = pb.SessionRequest(attach=pb.AttachOpen(session_id="s1", attach_token=token, route_epoch=epoch))
    return list(servicer.Session(iter([first, *steps]), Caller(str(FEEDER.peer_id), "feeder", 1)))


def test_a_new_feeder_gets_the_credit_the_last_one_spent():
    """Each link counts its credit from the grant: a relink must not find the
    session's credit spent by the link before it (it would fail honest steps)."""
    servicer, owner, pushed = _ring_servicer(credits=3)
    assert _attach_stream(servicer, b"t" * 32, 0, [_fed(0), _fed(1)])[0].HasField("accepted")
    replies = _attach_stream(servicer, b"t" * 32, 0, [_fed(2), _fed(3), _fed(4)])
    assert [r.WhichOneof("kind") for r in replies] == ["accepted"]  # three steps, no error: credit was given back
    assert [m.result.position for m in pushed] == [1, 2, 3, 4, 5]
    assert list(owner) == []


def test_an_attach_feeds_only_the_current_route_with_the_current_secret():
    servicer, owner, pushed = _ring_servicer()
    newer = _attach_stream(servicer, b"t" * 32, 5, [_fed(0, 5)])  # a route no client announced
    assert newer[0].error.code == pb.EPOCH_STALE and servicer._states["s1"].epoch == 0
    mixed = _attach_stream(servicer, b"t" * 32, 0, [_fed(0, 0), _fed(1, 1)])  # attached for 0, feeds 1
    assert mixed[0].HasField("accepted") and mixed[-1].error.code == pb.EPOCH_STALE and mixed[-1].error.terminal
    assert servicer._states["s1"].epoch == 0 and [m.result.position for m in pushed] == [1]
    # a secret too long is the request's error, and the session is as it was
    linked = servicer._states["s1"].ring.link = mock.Mock()  # a link it has: kept
    too_long = pb.RollbackSignal(position=1, route_epoch=1, attach_token=b"n" * 33)
    assert servicer.steps.rollback("s1", servicer._states["s1"], too_long).error.code == pb.INVALID_ARGUMENT
    assert servicer._states["s1"].epoch == 0 and servicer._states["s1"].ring.attach_token == b"t" * 32
    assert servicer._states["s1"].ring.link is linked and not linked.close.called
    servicer._states["s1"].ring.link = None
    # a failover: the client rolls the session back on a new route, with a new secret
    rollback = pb.SessionRequest(rollback=pb.RollbackSignal(position=1, route_epoch=1, attach_token=b"n" * 32))
    assert servicer.steps.rollback("s1", servicer._states["s1"], rollback.rollback).HasField("ack")
    old = _attach_stream(servicer, b"t" * 32, 1, [_fed(1, 1)])  # the replaced hop still knows the old one
    assert old[0].error.code == pb.UNKNOWN_SESSION
    assert _attach_stream(servicer, b"n" * 32, 1, [_fed(1, 1)])[0].HasField("accepted")
    assert [m.result.position for m in pushed] == [1, 2]
    assert list(owner) == []


def test_the_rings_dial_certificate_is_renewed_before_it_expires(monkeypatch):
    """A peer serving for days dials next hops with a client certificate that lasts 24 h."""
    from meshnet_p2p.dataplane import ring_links
    from meshnet_p2p.dataplane.transport.tls import cert_identity

    servicer = ShardRuntimeServicer(FakeEngine(*ROLES["middle"]), identity=CERTIFIER, now_ms=lambda: NOW)
    first = servicer.links.dial_credentials()
    assert servicer.links.dial_credentials() is first and cert_identity(first.cert_pem) == CERTIFIER.peer_id
    later = ring_links.time.monotonic() + ring_links.DIAL_CERT_RENEW_S + 1
    monkeypatch.setattr(ring_links.time, "monotonic", lambda: later)
    renewed = servicer.links.dial_credentials()
    assert renewed is not first and cert_identity(renewed.cert_pem) == CERTIFIER.peer_id
