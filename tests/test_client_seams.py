"""The client's seams, without a swarm: opening a route refuses cleanly and
leaves nothing open, the trio bridge, streamed text, and the typed values the
client hands the data plane (converted to protobuf in dataplane/wire.py only)."""

import dataclasses
import threading
from types import SimpleNamespace

import pytest
import trio

from meshnet_p2p._proto import shard_runtime_pb2 as pb
from meshnet_p2p.client import GenerationError, RouteOptions, open_route
from meshnet_p2p.client import bridge
from meshnet_p2p.route.hop import DishonestHop, Hop, check_commitment, commitments_of, route_fingerprint
from meshnet_p2p.route.ring import RingRoute
from meshnet_p2p.route.search import RouteSearch
from meshnet_p2p.route.star import StarRoute
from meshnet_p2p.client.text import TextStream, prompt_ids
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.dataplane import wire
from meshnet_p2p.dataplane.stub import ShardConnectionError, StepReply
from meshnet_p2p.engine.contract import HIDDEN, SamplingParams, Tensor, TensorBundle
from meshnet_p2p.swarm.placement import Span
from meshnet_p2p.trust.attestation import Attestation
from meshnet_p2p.trust.commitment import Commitment, hidden_digest, input_digest


# --- opening a route -------------------------------------------------------------------------------

def test_options_refuse_an_attesting_ring():
    with pytest.raises(ValueError, match="does not attest"):
        RouteOptions(max_tokens=8, ring=True, attest=True)


def test_a_route_refuses_options_of_the_other_kind_before_any_io():
    surveyed = []
    search = RouteSearch(lambda: surveyed.append(1) or [], RouteOptions(max_tokens=8, ring=True))
    with pytest.raises(ValueError, match="ring=False"):
        StarRoute([], search, 30)
    with pytest.raises(ValueError):
        RingRoute.open(lambda: surveyed.append(1) or [], 30, RouteOptions(max_tokens=8))
    assert surveyed == []  # constructing surveys nothing; a refused open neither


@pytest.mark.parametrize("ring", [False, True])
def test_a_route_with_no_peers_is_a_generation_error(ring):
    with pytest.raises(GenerationError, match="could not open a route for layers 0-29"):
        open_route(lambda: [], 30, RouteOptions(max_tokens=8, ring=ring, open_timeout=1.0))


class _Stream:
    session_id = "s" * 32

    def __init__(self, log: list) -> None:
        self.log = log

    def link(self, order, timeout=None):
        raise ShardConnectionError("gone")

    def release(self, timeout=None):
        self.log.append("released")

    def close(self):
        self.log.append("stream closed")


class _Client:
    def __init__(self, log: list) -> None:
        self.log = log

    def close(self):
        self.log.append("client closed")


class _Record:
    content = {}
    seq, expires_at_ms, wire = 1, 2**62, b"report"


def test_a_ring_that_cannot_link_closes_every_hop_it_opened(monkeypatch):
    log: list[str] = []

    def open_chain(self, start, end, epoch):
        return [Hop(Span(f"p{i}", i * 15, i * 15 + 15, record=_Record()), _Client(log), _Stream(log), 64)
                for i in range(2)]

    monkeypatch.setattr(RouteSearch, "open_chain", open_chain)
    with pytest.raises(GenerationError, match="gave up after 0 failovers"):
        RingRoute.open(lambda: [], 30, RouteOptions(max_tokens=8, ring=True, max_failovers=0))
    # no failover left to spend: every hop released and its connection let go
    assert log == ["released", "client closed"] * 2


# --- the bridge ------------------------------------------------------------------------------------

async def _where() -> trio.lowlevel.TrioToken:
    return trio.lowlevel.current_trio_token()


def test_many_liars_cost_a_route_search_rounds_that_grow_as_their_log(monkeypatch):
    """Identities cost nothing, nor does a report claiming the whole model, fast,
    at an address that never answers: the planner tries them first, and a
    first contact with each costs its timeout (3 s). At 16 contacts a round,
    400 liars cost 26 rounds, past the search's 60 s (bench/sim.py --sybils ...
    --sybil-behaviour liar counts them). The width doubles with what was set
    aside, so the rounds grow as the log of the liars' number."""
    from meshnet_p2p.route import search as search_module

    liars = [Span(f"liar{i:03d}", 0, 30, throughput=1000.0) for i in range(400)]
    honest = [Span("h0", 0, 15, throughput=60.0), Span("h1", 15, 30, throughput=60.0)]
    rounds = []

    def first_contacts(self, spans, wait_s=lambda: None):
        rounds.append(len(spans))
        for s in spans:  # a made-up address answers last: its timeout
            if s.peer_id[0] == "h":
                yield s.peer_id, search_module.Contact(s, SimpleNamespace(close=lambda: None), None)
        for s in spans:
            if s.peer_id[0] != "h":
                yield s.peer_id, ShardConnectionError("connect timed out")

    monkeypatch.setattr(RouteSearch, "_first_contacts", first_contacts)
    monkeypatch.setattr(search_module, "open_hop", lambda contact, opts, epoch: contact.span)
    search = RouteSearch(lambda: liars + honest, RouteOptions(max_tokens=8))
    search.survey()
    assert [h.peer_id for h in search.open_chain(0, 30, 0)] == ["h0", "h1"]
    assert len(rounds) <= 8, rounds  # 1, 16, 32, 64, 128, then 256 at once: every liar set aside
    assert max(rounds) <= search_module.MAX_PROBE_WIDTH


def _contacts_measuring(rtt_ms: dict[str, float], rounds: list, seen: list):
    """A stand-in for first contacts: each peer answers in ``rtt_ms``'s order (the order
    they come), its round trip measured as first_contact measures it; ``rounds``: each
    round's peers; ``seen``: each peer handed over (a round closed early stops there)."""
    from meshnet_p2p.route import search as search_module

    def first_contacts(self, spans, wait_s=lambda: None):
        rounds.append(sorted(s.peer_id for s in spans))
        for s in sorted(spans, key=lambda s: rtt_ms[s.peer_id]):
            self.measures.round_trip(s.peer_id, rtt_ms[s.peer_id])
            seen.append(s.peer_id)
            yield s.peer_id, search_module.Contact(s, SimpleNamespace(close=lambda: None), None)
    return first_contacts


def _open_with(monkeypatch, spans, rtt_ms):
    from meshnet_p2p.route import search as search_module

    rounds, seen = [], []
    monkeypatch.setattr(RouteSearch, "_first_contacts", _contacts_measuring(rtt_ms, rounds, seen))
    monkeypatch.setattr(search_module, "open_hop", lambda contact, opts, epoch: contact.span)
    search = RouteSearch(lambda: spans, RouteOptions(max_tokens=8))
    search.survey()
    return [h.peer_id for h in search.open_chain(0, 30, 0)], rounds, seen, search


def test_a_round_trip_not_yet_measured_is_priced_from_those_measured(monkeypatch):
    """Over the internet every round trip measures tens of ms, and an unmeasured peer was
    priced at a LAN's 2 ms: each round of first contacts made the untried look cheaper than
    what it had just measured, and a fresh client's search went on contacting for rounds
    (bench/sim.py: up to 5, 4.8 s to open). The first round looks beside its route; the
    plan that stands then is the cheapest of what answered, beside the untried priced at
    the median of what was measured."""
    spans = [Span(f"{k}{i}", 15 * i, 15 * (i + 1), throughput=tps) for k, tps in
             (("a", 60.0), ("b", 59.0), ("c", 58.0), ("d", 57.0)) for i in range(2)]
    rtt = {"a0": 90.0, "a1": 90.0, "b0": 40.0, "b1": 40.0, "c0": 60.0, "c1": 60.0, "d0": 70.0, "d1": 70.0}
    route, rounds, _, search = _open_with(monkeypatch, spans, rtt)
    assert route == ["b0", "b1"]  # the nearest of those contacted
    assert len(rounds) == 1 and set(rounds[0]) == set(rtt)  # one round, the route and the next-best beside it
    # what the planner is told of a peer not yet measured: the median of those measured
    # (of an even count the slower middle one), twice behind a relay
    measured = sorted(search.measures.latency_ms.values())
    assert search.measures.unmeasured_round_trip_ms() == measured[len(measured) // 2] == 60.0
    search.measures.latency_ms = {"x": 10.0, "y": 20.0, "z": 30.0, "w": 40.0, "v": 50.0}
    far = [Span("e0", 0, 30, throughput=60.0), Span("e1", 0, 30, throughput=60.0, relayed=True)]
    trips = search.measures.round_trips(spans + far)
    assert (trips["e0"], trips["e1"], trips["y"]) == (30.0, 60.0, 20.0)


def test_a_round_of_first_contacts_ends_once_its_plan_stands(monkeypatch):
    """A contact still out is not waited for once every hop of the plan answered: a
    made-up address costs its whole timeout, and the round's other contacts could change
    the plan only by answering faster than the typical round trip."""
    spans = [Span("h0", 0, 15, throughput=60.0), Span("h1", 15, 30, throughput=60.0),
             Span("s0", 0, 15, throughput=60.0, relayed=True), Span("s1", 15, 30, throughput=60.0, relayed=True)]
    route, rounds, seen, _ = _open_with(monkeypatch, spans, {"h0": 30.0, "h1": 30.0, "s0": 3000.0, "s1": 3000.0})
    assert route == ["h0", "h1"]
    assert rounds == [["h0", "h1", "s0", "s1"]]  # all four asked at once...
    assert seen == ["h0", "h1"]  # ...and the round closed once both hops had answered


def test_a_round_stops_waiting_for_a_hanging_address_once_a_route_of_peers_that_answered_stands(monkeypatch):
    """A whole-model claim at an address that hangs is planned first and contacted beside
    the honest chain; once the chain has answered, the round gives what is still out a
    grace (as long again, at least MIN_GRACE_S), not the connect timeout, and plans
    without it: not banned (nothing is known against it), and its connection, should it
    come, is closed."""
    from meshnet_p2p.route import search as search_module

    spans = [Span("liar", 0, 30, throughput=1000.0), Span("h0", 0, 15, throughput=60.0),
             Span("h1", 15, 30, throughput=60.0)]
    hang, closed = threading.Event(), threading.Event()

    def first_contact(span, opts, measures):
        if span.peer_id == "liar":
            assert hang.wait(30)  # released by the test once the route is open
            return search_module.Contact(span, SimpleNamespace(close=closed.set), None)
        measures.round_trip(span.peer_id, 50.0)
        return search_module.Contact(span, SimpleNamespace(close=lambda: None), None)

    monkeypatch.setattr(search_module, "first_contact", first_contact)
    monkeypatch.setattr(search_module, "open_hop", lambda contact, opts, epoch: contact.span)
    events = []
    search = RouteSearch(lambda: spans, RouteOptions(max_tokens=8, on_event=events.append))
    search.survey()
    try:
        assert [h.peer_id for h in search.open_chain(0, 30, 0)] == ["h0", "h1"]
        assert not hang.is_set()  # opened while the liar's contact was still out
        assert "liar" not in search.banned_now()
        assert events == ["not waiting for 1 slow first contacts"]
    finally:
        hang.set()
    assert closed.wait(30)  # the contact nobody took is let go


def test_from_plain_code_runs_each_async_call_in_a_loop_of_its_own():
    tokens = bridge.from_plain_code(lambda run: [run(_where), run(_where)])
    assert tokens[0] != tokens[1]


async def test_from_trio_runs_blocking_work_in_a_thread_and_async_calls_come_back():
    mine = threading.get_ident()
    thread, token = await bridge.from_trio(lambda run: (threading.get_ident(), run(_where)))
    assert thread != mine and token == trio.lowlevel.current_trio_token()


async def test_wait_event_does_not_block_the_loop():
    event = threading.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(bridge.wait_event, event)
        await trio.sleep(0)  # the loop runs on while the event is unset
        event.set()


# --- text ------------------------------------------------------------------------------------------

class _Tokenizer:
    def encode(self, text):
        return [ord(c) for c in text]

    def chat_prompt(self, text):
        return f"<{text}>"

    def stream_decoder(self):
        class Decoder:
            held = b""

            def feed(self, token):  # a byte a token: a character may take several
                self.held += bytes([token])
                try:
                    text, self.held = self.held.decode(), b""
                    return text
                except UnicodeDecodeError:
                    return ""

            def flush(self):
                return self.held.decode(errors="replace")
        return Decoder()


def test_prompt_ids_apply_the_chat_template_only_when_asked():
    assert prompt_ids(_Tokenizer(), "hi", False) == [104, 105]
    assert prompt_ids(_Tokenizer(), "hi", True) == [60, 104, 105, 62]


def test_text_stream_hands_on_whole_characters_and_the_rest_at_finish():
    out: list[str] = []
    text = TextStream(_Tokenizer(), out.append)
    for b in "é".encode() + b"a" + "é".encode()[:1]:
        text.on_token(b)
    text.finish()
    assert out == ["", "é", "a", "", "\ufffd"]
    assert TextStream(_Tokenizer(), None).on_token is None
    TextStream(_Tokenizer(), None).finish()  # nothing to stream, nothing to flush


# --- the typed values the client hands the data plane ------------------------------------------------

def test_route_fingerprint_spells_out_every_axis():
    fp = route_fingerprint({"model_digest": "m", "recipe_digest": "r", "recipe": {"n_ubatch": 64, "seam": "f32"}})
    msg = wire.fingerprint_to_proto(fp)
    assert (msg.model_digest, msg.recipe_digest, dict(msg.recipe_axes)) == ("m", "r", {"n_ubatch": "64", "seam": "f32"})
    assert wire.fingerprint_from_proto(msg) == fp


def test_link_rollback_sampling_and_capability_convert_field_for_field():
    order = wire.LinkOrder(route_epoch=3, peer_id="p", next_report=b"r", session_id="s", attach_token=b"t" * 32,
                           forward_until=9, stop_at_eog=True)
    link = wire.link_to_proto(order).link
    assert (link.route_epoch, link.peer_id, link.next_report, link.session_id, link.attach_token,
            link.forward_until, link.stop_at_eog) == (3, "p", b"r", "s", b"t" * 32, 9, True)
    rollback = wire.rollback_to_proto(5, 3, b"n" * 32).rollback
    assert (rollback.position, rollback.route_epoch, rollback.attach_token) == (5, 3, b"n" * 32)
    s = wire.sampling_to_proto(SamplingParams(0.5, 40, 0.9, 7))
    assert (round(s.temperature, 3), s.top_k, round(s.top_p, 3), s.seed) == (0.5, 40, 0.9, 7)
    cap = pb.Capability(fingerprint=pb.Fingerprint(model_digest="m", recipe_digest="r", recipe_axes={"a": "1"}))
    cap.layers.start, cap.layers.end = 10, 20
    assert wire.capability_from_proto(cap) == wire.PeerCapability(wire.Fingerprint("m", "r", {"a": "1"}), 10, 20)


def test_an_attestation_converts_to_the_trust_layers_value_and_still_verifies():
    me = Identity.generate()
    a = Attestation(str(me.peer_id), "s" * 32, "m", "r", 0, 10, 3, "i" * 64, "o" * 64).signed_by(me)
    m = pb.Attestation(peer_id=a.peer_id, session_id=a.session_id, model_digest=a.model_digest,
                       recipe_digest=a.recipe_digest, start=a.start, end=a.end, steps=a.steps,
                       input_digest=a.input_digest, output_digest=a.output_digest, signature=a.signature)
    back = wire.attestation_from_proto(m)
    assert back == a and back.verifies()


# --- a hop's commitments as a peer sent them (route/hop.py, route/ring.py), with stand-in replies ---

_PEER = Identity.from_seed(b"\x41" * 32)
_BEFORE = Identity.from_seed(b"\x42" * 32)
_MODEL, _RECIPE = "1" * 64, "2" * 64


def _signed_step(signer: Identity, start: int, end: int, session_id: str, payload, out):
    """A hop's honest reply to the step at position 0 (``payload`` in, hidden ``out`` back), and its commitment."""
    c = Commitment(str(signer.peer_id), session_id, _MODEL, _RECIPE, start, end, 0, 0, 0, False,
                   input_digest(0, payload), hidden_digest(0, out)).signed_by(signer)
    raw = pb.SessionResponse(result=pb.StepResult(position=3, route_epoch=0))
    reply = StepReply(3, out, None, False, raw, wire.commitment_from_proto(wire.commitment_to_proto(c, pb.StepCommitment())))
    return reply, c


def _hop(signer: Identity, start: int, end: int) -> Hop:
    span = Span(str(signer.peer_id), start, end,
                record=SimpleNamespace(content={"model_digest": _MODEL, "recipe_digest": _RECIPE}))
    return Hop(span, client=None, stream=SimpleNamespace(session_id=f"{start}-{end}-session"), n_ubatch=32)


def _tensor(fill: int) -> TensorBundle:
    return TensorBundle((Tensor(HIDDEN, "f32", (3, 4), bytes([fill]) * 48),))


def test_an_honest_commitment_passes_both_checks():
    hop = _hop(_PEER, 10, 20)
    reply, c = _signed_step(_PEER, 10, 20, hop.stream.session_id, _tensor(1), _tensor(2))
    check_commitment(hop, 0, _tensor(1), reply)
    hop.history.append((0, _tensor(1), False))
    hop.replies.append(reply)
    assert commitments_of(hop) == [c]


@pytest.mark.parametrize("why, wire_change, epoch", [
    ("short output digest", {"output_digest": b"\0" * 31}, 0),
    ("long input digest", {"input_digest": b"\0" * 33}, 0),
    ("short signature", {"signature": b"\0" * 63}, 0),
    ("long signature", {"signature": b"\0" * 65}, 0),
    ("huge index", {"index": 2**64 - 1}, 0),
    ("zero signature", {"signature": b"\0" * 64}, 0),
    ("reply on a huge epoch", {}, 2**64 - 1),  # the epoch a reply names: a peer's number too
])
def test_a_malformed_commitment_in_a_reply_is_a_dishonest_hop(why, wire_change, epoch):
    """Whatever a peer puts in its reply's commitment, the client's checks end in a
    DishonestHop naming that peer (a ShardConnectionError: failed over), never
    in another exception."""
    hop = _hop(_PEER, 10, 20)
    reply, _ = _signed_step(_PEER, 10, 20, hop.stream.session_id, _tensor(1), _tensor(2))
    reply.commitment = dataclasses.replace(reply.commitment, **wire_change)
    reply.raw.result.route_epoch = epoch
    with pytest.raises(DishonestHop) as e:
        check_commitment(hop, 0, _tensor(1), reply)  # on the spot: digests and index
        hop.history.append((0, _tensor(1), False))
        hop.replies.append(reply)
        commitments_of(hop)  # after the generation: whole, chained, signed
    assert isinstance(e.value, ShardConnectionError) and e.value.peer_id == str(_PEER.peer_id), why


@pytest.mark.parametrize("why, wire_change", [
    ("short prev", {"prev": b"\0" * 5}),
    ("long session id", {"session_id": "s" * 5000}),
    ("huge position", {"position": 2**63}),
    ("short signature", {"signature": b"\0" * 63}),
])
def test_a_ring_hop_that_relays_a_malformed_commitment_is_blamed_for_it(why, wire_change):
    """A ring hop's copy names the commitment it took the step with (upstream); a
    malformed one is that hop's fault (it must have checked it), typed, on the spot."""
    before, hop = _hop(_BEFORE, 0, 10), _hop(_PEER, 10, 20)
    tokens = (1, 2, 3)
    first, c0 = _signed_step(_BEFORE, 0, 10, before.stream.session_id, tokens, _tensor(1))
    before.history.append((0, tokens, False))
    before.replies.append(first)
    copy, _ = _signed_step(_PEER, 10, 20, hop.stream.session_id, _tensor(1), _tensor(2))
    relayed = wire.commitment_from_proto(wire.commitment_to_proto(c0, pb.StepCommitment(), forwarded=True))
    # (another signature than the one the client got: else the fields name that one, checked after the generation)
    copy.upstream = dataclasses.replace(relayed, **{"signature": b"\1" * 64, **wire_change})
    ring = object.__new__(RingRoute)
    ring.hops = [before, hop]
    index, error = ring._upstream_fault(1, copy)
    assert index == 1 and isinstance(error, DishonestHop) and error.peer_id == str(_PEER.peer_id), why


def _reported(peer: Identity, start: int, end: int, host: str, **kw) -> Span:
    """A span whose report names a direct address (what the probe connects to)."""
    record = SimpleNamespace(content={"addrs": [f"/ip4/{host}/tcp/4001/p2p/{peer.peer_id}"]})
    return Span(str(peer.peer_id), start, end, record=record, **kw)


def test_a_probe_before_the_first_plan_finds_the_near_peers_and_leaves_out_made_up_addresses(monkeypatch):
    """Planned blind, a fresh client's ring took 2-3x the fastest (bench/sim.py), and a
    crowd of liars at made-up addresses cost it a first contact's timeout a round. A TCP
    connect to every candidate first (one round trip each) prices the first plan by the
    client's own round trips, and what never answers is left out of it."""
    from meshnet_p2p.route import search as search_module
    from meshnet_p2p.route.search import direct_address

    far = [_reported(Identity.generate(), 15 * i, 15 * (i + 1), f"10.0.1.{i + 1}", throughput=60.0) for i in range(2)]
    near = [_reported(Identity.generate(), 15 * i, 15 * (i + 1), f"10.0.2.{i + 1}", throughput=50.0) for i in range(2)]
    liars = [_reported(Identity.generate(), 0, 30, f"10.0.3.{i + 1}", throughput=1000.0) for i in range(40)]
    rtt = {s.peer_id: 150.0 for s in far} | {s.peer_id: 20.0 for s in near}
    at = {direct_address(s): s.peer_id for s in liars + far + near}
    probed = []

    def probe(self, targets):
        probed.append({at[a] for a in targets})
        return {a: rtt[at[a]] for a in targets if at[a] in rtt}  # the liars' addresses never answer

    rounds, seen = [], []
    monkeypatch.setattr(RouteSearch, "_probe_round_trips", probe)
    monkeypatch.setattr(RouteSearch, "_first_contacts", _contacts_measuring(rtt, rounds, seen))
    monkeypatch.setattr(search_module, "open_hop", lambda contact, opts, epoch: contact.span)
    search = RouteSearch(lambda: liars + far + near, RouteOptions(max_tokens=8))
    search.survey()
    assert [h.peer_id for h in search.open_chain(0, 30, 0)] == [s.peer_id for s in near]
    assert probed == [{s.peer_id for s in liars + far + near}]  # once, every direct candidate
    assert len(rounds) == 1 and not set(rounds[0]) & {s.peer_id for s in liars}  # no liar contacted


def test_a_crowd_of_reports_naming_one_address_probes_it_a_bounded_number_of_times(monkeypatch):
    """A report may name anyone's address: 100 identities naming ports of one victim's IP
    must not make every fresh client connect there 100 times. One probe an address, at
    most PROBES_PER_HOST ports of one IP; the claimants of an address that answered share
    its round trip; past the cap, a peer of a host none of whose probed ports answered
    is unanswered (one made-up address for a crowd), else it stays unmeasured."""
    from meshnet_p2p.route.probe import PROBES_PER_HOST

    victim = [_reported(Identity.generate(), 0, 30, "10.9.9.9", throughput=1000.0) for _ in range(100)]
    for i, s in enumerate(victim):  # half of them name one port, the rest a port each
        s.record.content["addrs"][0] = s.record.content["addrs"][0].replace("/tcp/4001/", f"/tcp/{4001 + (i % 2) * i}/")
    honest = [_reported(Identity.generate(), 0, 30, "10.0.0.1", throughput=60.0)]
    probed = []

    def probe(self, targets):
        probed.append(list(targets))
        return {a: 50.0 for a in targets}

    monkeypatch.setattr(RouteSearch, "_probe_round_trips", probe)
    search = RouteSearch(lambda: victim + honest, RouteOptions(max_tokens=8))
    search.survey()
    assert search.probe(0, 30, set()) == set()
    (targets,) = probed
    assert len([a for a in targets if a[0] == "10.9.9.9"]) == PROBES_PER_HOST and ("10.0.0.1", 4001) in targets
    same_port = [s.peer_id for i, s in enumerate(victim) if i % 2 == 0]
    assert all(search.measures.latency_ms.get(p) == 50.0 for p in same_port)  # ("10.9.9.9", 4001): probed once
    assert len([p for p in search.measures.latency_ms if p not in same_port]) == PROBES_PER_HOST - 1 + 1  # + honest

    def silent(self, targets):  # the victim's IP answers on no port: every one of its claimants is left out
        return {a: 50.0 for a in targets if a[0] != "10.9.9.9"}

    monkeypatch.setattr(RouteSearch, "_probe_round_trips", silent)
    fresh = RouteSearch(lambda: victim + honest, RouteOptions(max_tokens=8))
    fresh.survey()
    assert fresh.probe(0, 30, set()) == {s.peer_id for s in victim}
