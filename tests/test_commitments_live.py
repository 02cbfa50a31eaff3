"""Per-step signed commitments with real peers (issue 26, point 1; docs/ring.md).

Real llama.cpp shards behind real servicers over real TLS sockets, in this
process so that one of them can be made a cheater (a test double: its forward
to the next hop is perturbed, with a valid CRC, while its copy to the client
is honest). Honest peers commit to every step, star and ring alike, and their
commitments verify and chain (across a ring's rollback too); a ring hop that
forwards one thing and copies the client another is caught on the spot and
blamed, alone, and the generation still equals the whole model's."""

from __future__ import annotations

import dataclasses

import pytest

from meshnet_p2p._proto import shard_runtime_pb2 as pb
from meshnet_p2p.client import RouteOptions
from meshnet_p2p.route.generation import generate
from meshnet_p2p.route.hop import DishonestHop, commitments_of
from meshnet_p2p.route.ring import RingRoute
from meshnet_p2p.route.star import StarRoute
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.core.records import RecordVerifier, wall_ms
from meshnet_p2p.dataplane.servicer import ShardRuntimeServicer
from meshnet_p2p.dataplane.transport.server import Server
from meshnet_p2p.dataplane.transport.tls import make_tls_credentials
from meshnet_p2p.dataplane.wire import bundle_from_proto, crc32c
from meshnet_p2p.engine.tokenizer import Tokenizer
from meshnet_p2p.swarm.capability import CAPABILITY, CAPABILITY_TYPE, CapabilityReport
from meshnet_p2p.swarm.placement import Span
from meshnet_p2p.trust.commitment import hidden_digest

from tests.conftest import N_UBATCH
from tests.reference import reference_generate

PROMPT = "The quick brown fox jumps over the lazy dog because"
TOKENS = 8
_REPORTS = RecordVerifier({CAPABILITY: CAPABILITY_TYPE})


class Peer:
    """A servicer with an identity over a real server, and the span its signed report makes."""

    def __init__(self, engine, seed: int, throughput: float = 100.0) -> None:
        self.identity = Identity.from_seed(bytes([seed]) * 32)
        creds = make_tls_credentials(self.identity)
        self.servicer = ShardRuntimeServicer(engine, identity=self.identity)
        self.server = self.servicer.register(Server(creds)).start()
        c = engine.capabilities()
        addr = f"/ip4/127.0.0.1/tcp/{self.server.port}/p2p/{self.identity.peer_id}"
        now = wall_ms()
        wire = CapabilityReport(c.model_digest, c.recipe_digest, (c.start, c.end), (addr,), throughput=throughput,
                                free_sessions=4, tls_cert=creds.cert_pem.decode(), recipe=c.recipe).sign(
            self.identity, seq=now, now_ms=now)
        self.span = Span.from_report(_REPORTS.verify(wire, now, remember=False))
        self.peer_id = str(self.identity.peer_id)

    def stop(self) -> None:
        self.server.stop(0)


@pytest.fixture(scope="module")
def prompt(model_path):
    return Tokenizer(model_path).encode(PROMPT)


@pytest.fixture(scope="module")
def reference(model_path, prompt):
    return reference_generate(model_path, prompt, TOKENS, n_ubatch=N_UBATCH)[0]


@pytest.fixture
def peers(shard_dir, load_engine, model_digest):
    """Head, middle, tail, and a second middle (the replacement a failover finds)."""
    made = [Peer(load_engine(shard_dir[span], source_sha256=model_digest), seed)
            for seed, span in enumerate([(0, 10), (10, 20), (20, 30), (10, 20)], start=0x41)]
    yield made
    for p in made:
        p.stop()


def _open(route_type, peers, *, ring: bool, later=(), events=None):
    """A route over ``peers``; ``later`` appear in the survey after the first (a failover's)."""
    surveys = []

    def spans():
        surveys.append(1)
        return [p.span for p in peers] + ([p.span for p in later] if len(surveys) > 1 else [])

    opts = RouteOptions(max_tokens=64, ring=ring, step_timeout=10.0, stop_at_eog=False,
                        on_event=(events.append if events is not None else lambda m: None))
    return route_type.open(spans, 30, opts)


@pytest.mark.parametrize("route_type", [StarRoute, RingRoute])
def test_honest_peers_commit_to_every_step_and_their_commitments_verify(peers, prompt, reference, route_type):
    route = _open(route_type, peers[:3], ring=route_type is RingRoute)
    try:
        assert generate(route, prompt, TOKENS, stop_at_eog=False).token_ids == reference
        steps = len(route.hops[0].replies)
        assert route.verify_commitments() == 3 * steps
        for hop, peer in zip(route.hops, peers):
            chain = commitments_of(hop)
            assert [c.index for c in chain] == list(range(steps)) and chain[0].peer_id == peer.peer_id
            first_input = hop.history[0][1]
            if hop is not route.hops[0]:  # what it took in is what the hop before it gave out
                assert chain[0].input_digest == hidden_digest(0, first_input)
        if route_type is RingRoute:  # each copy names the commitment of the hop before it, as that one sent it
            for before, hop in zip(route.hops, route.hops[1:]):
                assert all(r.upstream.names(c) for r, c in zip(hop.replies, commitments_of(before)))
        # a signature that does not verify is named, with its hop, after the generation
        middle = route.hops[1]
        r = middle.replies[2]
        middle.replies[2] = dataclasses.replace(r, commitment=dataclasses.replace(r.commitment,
                                                                                  signature=bytes(64)))
        with pytest.raises(DishonestHop) as e:
            route.verify_commitments()
        assert e.value.peer_id == peers[1].peer_id
    finally:
        route.close()


def _perturbed(bundle: pb.TensorBundle) -> pb.TensorBundle:
    """The same hidden state slightly changed, with a valid CRC: what a careful cheater forwards."""
    out = pb.TensorBundle()
    out.CopyFrom(bundle)
    t = out.tensors[0]
    data = bytearray(b"".join(f.payload for f in t.fragments))
    data[5] ^= 0x01
    del t.fragments[:]
    t.fragments.add(byte_offset=0, payload=bytes(data))
    t.crc32c = crc32c(bytes(data))
    return out


def _cheat(peer: Peer, from_position: int, *, equivocate: bool) -> list[int]:
    """Make ``peer`` forward a perturbed hidden state from ``from_position`` on, its copy to
    the client honest: with its honest commitment (the next hop refuses the step), or
    with one it signs for the perturbed state (two commitments for one step)."""
    steps = peer.servicer.steps
    honest = steps._forward
    cheated: list[int] = []

    def forward_step(state, step, result, response, commitment):
        link = state.ring.link
        if link is None or step.position < from_position:
            return honest(state, step, result, response, commitment)
        forward = link.forward

        def lying_forward(position, decode, *, hidden=None, upstream=None, **kw):
            bad = _perturbed(hidden)
            if equivocate:
                upstream = dataclasses.replace(
                    upstream, output_digest=hidden_digest(position, bundle_from_proto(bad))).signed_by(peer.identity)
            cheated.append(position)
            return forward(position, decode, hidden=bad, upstream=upstream, **kw)

        link.forward = lying_forward
        try:
            return honest(state, step, result, response, commitment)
        finally:
            link.forward = forward

    steps._forward = forward_step
    return cheated


@pytest.mark.parametrize("equivocate", [False, True], ids=["refused-by-next-hop", "equivocation"])
def test_a_ring_hop_that_forwards_one_thing_and_copies_another_is_caught_and_blamed(
        peers, prompt, reference, equivocate):
    head, cheater, tail, twin = peers
    cheated = _cheat(cheater, len(prompt) + 2, equivocate=equivocate)
    events: list[str] = []
    route = _open(RingRoute, [head, cheater, tail], ring=True, later=[twin], events=events)
    try:
        result = generate(route, prompt, TOKENS, stop_at_eog=False)
        assert result.token_ids == reference  # the cheat never reached the answer
        assert cheated, "the cheater never forwarded a step"
        assert route.failovers == 1, events  # caught on the spot, at its first cheat, and nobody else blamed
        assert [h.span.peer_id for h in route.hops] == [head.peer_id, twin.peer_id, tail.peer_id]
        assert set(route.search.banned) == {cheater.peer_id}
        assert any(cheater.peer_id in e and "rerouting the ring" in e for e in events), events
        # the hops that stayed rolled back and chained on: every commitment still verifies
        assert route.verify_commitments() > 0
    finally:
        route.close()
