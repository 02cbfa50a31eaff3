"""The simulator (meshnet_p2p/sim, bench/sim.py): its network, its stand-in
signatures, and that it runs the production DHT code it claims to."""

from __future__ import annotations

import math
import random

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnet_p2p.core.identity import Identity, signed_by_peer
from meshnet_p2p.core.records import RecordRejected, RecordVerifier, sign_record
from meshnet_p2p.swarm.capability import CAPABILITY
from meshnet_p2p.swarm.node import TYPES
from meshnet_p2p.testing import sample_report
from meshnet_p2p.dht import refresh
from meshnet_p2p.dht.node import DHTConfig
from meshnet_p2p.sim.churn import Churn
from meshnet_p2p.sim.crypto import stand_in_signatures
from meshnet_p2p.sim.shared import shared_record_checks
from meshnet_p2p.sim.net import RTT_MS, NetModel, SimNetwork
from meshnet_p2p.sim.swarm import SimConfig, simulate


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


async def test_a_datagram_arrives_after_its_one_way_delay_and_a_nat_takes_only_answers(autojump_clock):
    net = SimNetwork(random.Random(1), NetModel(loss=0.0))
    a, b = net.host(region="na"), net.host(region="eu")
    hidden = net.host(region="eu", natted=True)
    ta, tb, th = net.attach(a), net.attach(b), net.attach(hidden)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(net.run)
        t0 = trio.current_time()
        await ta.send(b"hello", b.addr)
        assert await tb.receive() == (b"hello", a.addr)
        one_way = RTT_MS["na", "eu"] / 2000 + a.access_s + b.access_s
        assert one_way <= trio.current_time() - t0 < one_way + net.model.tick_s  # at the tick it falls in
        await ta.send(b"unasked", hidden.addr)  # nobody reaches a host behind NAT unasked...
        await trio.sleep(1)
        await th.send(b"question", a.addr)
        assert (await ta.receive())[0] == b"question"
        await ta.send(b"answer", hidden.addr)  # ...but its NAT lets the answer in
        assert await th.receive() == (b"answer", a.addr)
        assert net.lost == 1
        tb.close()
        await ta.send(b"to nobody", b.addr)  # a host that left: lost, like UDP
        await trio.sleep(1)
        assert net.lost == 2
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("filtering", ["address", "endpoint"])
async def test_a_nat_lets_in_what_its_filtering_lets_in_while_its_mapping_is_open(filtering, autojump_clock):
    """RFC 4787's filtering: an address-dependent NAT takes only the addresses its host
    sent to; an endpoint-independent one ("full cone") anyone, while its host's mapping
    is open (nat_window_s since it last sent); neither takes anything before it."""
    net = SimNetwork(random.Random(1), NetModel(loss=0.0, nat_filtering=filtering, nat_window_s=10.0))
    hidden, asked, stranger = net.host(natted=True), net.host(), net.host()
    th, ta, ts = net.attach(hidden), net.attach(asked), net.attach(stranger)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(net.run)
        await ts.send(b"before", hidden.addr)  # no mapping yet: dropped by both
        await trio.sleep(1)
        await th.send(b"hello", asked.addr)
        await ta.receive()
        await ta.send(b"answer", hidden.addr)
        await ts.send(b"stranger", hidden.addr)
        await trio.sleep(1)
        got = []
        while th._inbox.items:
            got.append((await th.receive())[0])
        assert sorted(got) == ([b"answer", b"stranger"] if filtering == "endpoint" else [b"answer"])
        await trio.sleep(20)  # the mapping closed: nobody again
        await ta.send(b"late", hidden.addr)
        await trio.sleep(1)
        assert not th._inbox.items
        nursery.cancel_scope.cancel()
    with pytest.raises(ValueError, match="nat_filtering"):
        NetModel(nat_filtering="symmetric")


async def test_a_host_s_uplink_sends_a_burst_one_datagram_after_another_at_its_rate(autojump_clock):
    """--uplink-mbps: ten datagrams of 12,500 bytes sent at once from a 1 Mbps uplink leave
    0.1 s apart, the first after its own 0.1 s; the link's delay comes on top. What would
    wait longer than the queue holds is dropped. Without an uplink rate: all at once."""
    net = SimNetwork(random.Random(1), NetModel(loss=0.0, uplink_mbps=20.0))
    a, b = net.host(region="na"), net.host(region="na")
    assert a.uplink_bps > 0 and a.uplink_bps != b.uplink_bps  # (drawn per host)
    a.uplink_bps = 1e6
    ta, tb = net.attach(a), net.attach(b)
    one_way = net.one_way_s(a, b)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(net.run)
        t0 = trio.current_time()
        for i in range(10):
            await ta.send(bytes([i]) * 12_500, b.addr)
        for i in range(10):
            data, _ = await tb.receive()
            assert data[0] == i
            assert (i + 1) * 0.1 + one_way <= trio.current_time() - t0 < (i + 1) * 0.1 + one_way + 0.0011
        net.model.uplink_queue_s = 0.25  # a queue of a quarter second: the rest of a burst is dropped
        t2 = trio.current_time()
        for i in range(5):
            await ta.send(bytes([i]) * 12_500, b.addr)
        assert (net.queue_dropped, net.lost) == (2, 2)  # those that would start after 0.3 s
        for i in range(3):
            assert (await tb.receive())[0][0] == i
        assert trio.current_time() - t2 < 0.3 + one_way + 0.0011 and not tb._inbox.items
        a.uplink_bps = 0.0  # unlimited: a burst arrives together
        t1 = trio.current_time()
        for i in range(3):
            await ta.send(b"x" * 12_500, b.addr)
        for i in range(3):
            await tb.receive()
            assert trio.current_time() - t1 < one_way + 0.0011
        nursery.cancel_scope.cancel()


async def test_datagrams_due_within_one_tick_arrive_together_and_tick_zero_keeps_exact_times(autojump_clock):
    for tick in (0.001, 0.0):
        net = SimNetwork(random.Random(1), NetModel(loss=0.0, tick_s=tick))
        a, b = net.host(region="eu"), net.host(region="eu")
        ta, tb = net.attach(a), net.attach(b)
        one_way = RTT_MS["eu", "eu"] / 2000 + a.access_s + b.access_s
        async with trio.open_nursery() as nursery:
            nursery.start_soon(net.run)
            due = math.ceil((trio.current_time() + 0.01 + one_way) / 0.001) * 0.001  # a tick's end
            t0 = due - one_way - 0.0009  # sent so as to arrive 0.9 and 0.5 ms before it
            await trio.sleep_until(t0)
            await ta.send(b"first", b.addr)
            await trio.sleep(0.0004)
            await ta.send(b"second", b.addr)
            arrivals = []
            for _ in range(2):
                await tb.receive()
                arrivals.append(trio.current_time())
            if tick:
                assert arrivals == pytest.approx([due, due], abs=1e-9)
            else:
                assert arrivals == pytest.approx([t0 + one_way, t0 + 0.0004 + one_way], abs=1e-9)
            nursery.cancel_scope.cancel()


async def test_a_socket_keeps_what_arrived_in_order_across_a_cancelled_receive_and_ends_when_closed(autojump_clock):
    net = SimNetwork(random.Random(1), NetModel(loss=0.0))
    a, b = net.host(region="eu"), net.host(region="eu")
    ta, tb = net.attach(a), net.attach(b)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(net.run)
        with trio.move_on_after(0.001):  # gives up before anything arrives
            await tb.receive()
        for i in range(3):  # due within one tick: delivered together, while nobody receives
            await ta.send(b"%d" % i, b.addr)
        await trio.sleep(1)
        assert [await tb.receive() for _ in range(3)] == [(b"0", a.addr), (b"1", a.addr), (b"2", a.addr)]
        ended = []

        async def receive_until_closed() -> None:
            with pytest.raises(trio.EndOfChannel):
                await tb.receive()
            ended.append(trio.current_time())

        nursery.start_soon(receive_until_closed)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trio.BusyResourceError):  # one reader a socket, as a node's receive loop
            await tb.receive()
        tb.close()
        await trio.testing.wait_all_tasks_blocked()
        assert ended == [trio.current_time()]
        nursery.cancel_scope.cancel()


async def test_a_partition_drops_what_crosses_it_until_it_heals(autojump_clock):
    net = SimNetwork(random.Random(1), NetModel(loss=0.0))
    asia, asia2, europe = net.host(region="as"), net.host(region="as"), net.host(region="eu")
    ta, ta2, te = net.attach(asia), net.attach(asia2), net.attach(europe)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(net.run)
        net.cut = frozenset({"as"})
        assert net.side(asia) and not net.side(europe)
        await ta.send(b"across", europe.addr)
        await ta.send(b"within", asia2.addr)
        assert await ta2.receive() == (b"within", asia.addr)
        await trio.sleep(5)
        assert net.partitioned == 1 and net.lost == 0
        net.cut = frozenset()  # healed
        await ta.send(b"across", europe.addr)
        assert await te.receive() == (b"across", asia.addr)
        nursery.cancel_scope.cancel()


def test_stand_in_signatures_verify_only_their_signer_and_bytes_and_go_away():
    alice, mallory = Identity.from_seed(b"\x01" * 32), Identity.from_seed(b"\x02" * 32)
    real = alice.sign(b"data")
    with stand_in_signatures():
        sig = alice.sign(b"data")
        assert len(sig) == 64 and sig != real
        assert alice.peer_id.verify(sig, b"data")
        assert not alice.peer_id.verify(sig, b"datA")  # other bytes
        assert not alice.peer_id.verify(mallory.sign(b"data"), b"data")  # another signer's
        assert not alice.peer_id.verify(real, b"data")  # only stand-ins while it lasts
        # statements (attestations, commitments) verify through the same stand-in
        assert signed_by_peer(str(alice.peer_id), sig, b"data")
        assert not signed_by_peer(str(alice.peer_id), mallory.sign(b"data"), b"data")
    assert alice.peer_id.verify(real, b"data") and not alice.peer_id.verify(sig, b"data")
    assert signed_by_peer(str(alice.peer_id), real, b"data") and not signed_by_peer(str(alice.peer_id), sig, b"data")


_T0 = 1_800_000_000_000
_ALICE, _BOB = Identity.from_seed(b"\x03" * 32), Identity.from_seed(b"\x04" * 32)
_REPORT = sample_report(_ALICE, "ab" * 32)


def _corpus() -> list[bytes]:
    """Records a node may be handed: good ones, and one for each way to fail."""
    good = [_REPORT.sign(_ALICE, seq=seq, now_ms=_T0 + seq, ttl_ms=60_000) for seq in (1, 2)]
    forged = bytearray(good[0])
    forged[-1] ^= 1
    return [*good,
            _REPORT.sign(_ALICE, seq=3, now_ms=_T0 + 200_000, ttl_ms=60_000),  # from the future at first
            bytes(forged),  # its signature altered
            sample_report(_BOB, "ab" * 32).sign(_ALICE, seq=4, now_ms=_T0, ttl_ms=60_000),  # claims Bob
            sign_record(_ALICE, "no-such-type", {"peer_id": str(_ALICE.peer_id)}, seq=5, now_ms=_T0, ttl_ms=60_000),
            b"\x97junk"]


_CORPUS = _corpus()


class _Alone(RecordVerifier):
    checked = RecordVerifier.checked  # the unshared check (bound at import), whatever the base class's is later


def _outcome(verifier: RecordVerifier, wire: bytes, now: int, remember: bool):
    try:
        r = verifier.verify(wire, now, remember=remember)
    except RecordRejected as e:
        return "rejected", e.reason
    return "ok", r.payload_type, dict(r.content), r.seq, r.issued_at_ms, r.expires_at_ms, r.signer, r.wire


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 6), st.integers(0, 300_000), st.booleans()),
                max_size=30))
def test_a_record_checked_once_for_the_swarm_is_taken_or_refused_by_each_node_as_if_it_checked_alone(ops):
    # three nodes (one knowing no capability reports), each with its own replay state,
    # beside three twins that check everything themselves: every verdict the same
    corpus, real = _CORPUS, RecordVerifier.checked
    kinds = [TYPES, TYPES, {k: v for k, v in TYPES.items() if k != CAPABILITY}]
    now = [_T0]
    with shared_record_checks(lambda: now[0]) as passed:
        shared, alone = [RecordVerifier(t) for t in kinds], [_Alone(t) for t in kinds]
        for node, i, dt, remember in ops:
            now[0] = _T0 + dt
            expect = _outcome(alone[node], corpus[i], now[0], remember)
            assert _outcome(shared[node], corpus[i], now[0], remember) == expect
        assert all(r.wire in corpus[:3] for r in passed.values())  # only records that passed are kept
        a, b = (RecordVerifier(TYPES).verify(corpus[0], _T0 + 1) for _ in range(2))
        assert a is b  # and every node is handed the one record
    assert RecordVerifier.checked is real  # and it goes away


SMALL = dict(peers=30, minutes=0.5, warmup_minutes=1.0, seed=3)
WITH = dict(reachability=True, relays=2, relay_capacity=3)  # the shared run's extras


@pytest.fixture(scope="module")
def small():
    """One run of the small swarm, shared: each costs ~20 s of CI."""
    return simulate(SimConfig(**SMALL, **WITH))


def test_a_small_simulated_swarm_finds_its_models_and_nodes(small):
    doc = small
    assert doc["model_lookups"] >= 20 and doc["node_lookups"] >= 10
    assert doc["model_lookup_found_any"] >= 0.9 and doc["model_lookup_recall_mean"] >= 0.8
    assert doc["node_lookup_success"] >= 0.9  # (0.88-0.91 before the target was waited for and asked again)
    assert 0 < doc["model_lookup_s_p50"] < 2.0  # simulated seconds: a few internet round trips
    assert doc["messages_per_node_s"] > 0 and doc["requests_per_node_s"]
    # (30 peers over 4 models x 3 slices: mostly holes, see below.) How many start is the
    # seed's alone (13 for seed 3), and every one started is reported, slow ones too
    assert doc["surveys"] >= 5
    # where the wall time went (the join storm, the window, the window's surveys ending)
    assert set(doc["wall_s_by_phase"]) == {"warmup", "measured", "grace"}
    assert abs(sum(doc["wall_s_by_phase"].values()) - doc["wall_s"]) < 0.5
    assert 0 <= doc["grace_s"] <= 300 and doc["warmup_s"] == 60


def test_joining_volunteers_learn_whether_others_can_dial_them(small):
    """Reachability checks (nat/reachability.py's asker, nat/dialer.py's dialers, the real
    dial_back requests over the simulated DHT): a public volunteer hears "reachable", one
    behind NAT never does, whatever the swarm's churn. (That a NATed address hears
    "unreachable" is shown on real nodes: test_reachability.py. Here it hung on chance:
    a run whose only NATed check had too few dialers to ask said "unknown", rightly,
    and failed CI-T of e86d861 on 2026-12-06.)"""
    outcomes, checks = small["reachability_outcomes"], small["reachability_checks"]
    assert checks >= 2, small  # (the joins of the run: 4-11 seen)
    # never a wrong answer; "unknown" is not wrong: 3 dialers asked, 2 must agree, and in a
    # 30-peer swarm a NATed volunteer's table may hold only 2 to ask (1 of 20 runs saw one)
    assert outcomes.get("public unreachable", 0) == 0 and outcomes.get("natted reachable", 0) == 0, small
    assert outcomes.get("public reachable", 0) >= 1, small
    # most conclude: a quarter unknown at most, or the one thin table above
    unknown = checks - outcomes.get("public reachable", 0) - outcomes.get("natted unreachable", 0)
    assert unknown <= max(1, checks // 4), small


def test_natted_volunteers_reserve_on_relays_within_their_bound(small):
    """A NATed volunteer's RelayKeeper (its offers(): the relays' signed records, one per
    network, round trips measured; rank_relays) reserves on a relay with room; no relay
    holds more than its bound."""
    assert small["natted_volunteers_relayed"] >= 0.6, small  # (one joining at a sample: not yet)
    assert small["relay_reservations_max"] <= 3, small
    assert small["relay_found_s_p50"] is not None and small["relay_found_s_p50"] < 10, small


@pytest.mark.parametrize("bad", ["blackhole", "selective"])
def test_natted_volunteers_move_when_their_relay_leaves_and_pass_over_one_that_does_not_carry(bad):
    """The production RelayKeeper (nat/keeper.py) in the simulation: relays come and go
    (sessions of half a minute, median), and one more relay takes reservations, claims
    to be empty and carries nothing (blackhole) or only its reserved peers' own dials
    (selective). Volunteers behind NAT reserve again when theirs leaves, and the
    keeper's check (reachability.relay_check: others dial it through the relay, here
    the public volunteers as dialers) passes the bad one over: nobody stays on it."""
    doc = simulate(SimConfig(peers=40, minutes=2.0, warmup_minutes=1.0, seed=4, models=1, nat_share=0.6,
                             relays=3, relay_capacity=8, relay_session_minutes=0.5, bad_relays=1,
                             bad_relay_behaviour=bad, reachability=True, surveys_per_s=0.1, generation_tokens=0))
    assert doc["relay_losses"] >= 1, doc  # relays left while volunteers held reservations on them
    assert doc["relay_found_again"] >= 1, doc  # and they reserved again
    assert doc["natted_volunteers_relayed"] == doc["natted_volunteers_carried"] > 0, doc  # never on the bad one


def test_the_oracle_prices_a_ring_and_finds_the_fastest():
    """Three slices, two peers each; the oracle's ring beats every other choice."""
    from types import SimpleNamespace

    from meshnet_p2p.sim.clients import Clients
    from meshnet_p2p.sim.records import SLICES
    from meshnet_p2p.swarm.placement import Span

    net = SimNetwork(random.Random(2), NetModel(loss=0.0))
    peers = {}
    for i, (a, b) in enumerate(SLICES * 2):
        peers[f"p{i}"] = SimpleNamespace(host=net.host(region="eu" if i < 3 else "as"), compute_ms=5.0 + i,
                                         relay=None)
    clients = Clients(SimpleNamespace(net=net, m=None, rng=None, cfg=SimpleNamespace(probe=False, seed=1)))
    spans = [Span(f"p{i}", a, b) for i, (a, b) in enumerate(SLICES * 2)]
    best = clients._oracle_ms(spans, peers)
    every = [clients._ring_ms([peers[f"p{x}"], peers[f"p{y}"], peers[f"p{z}"]])
             for x in (0, 3) for y in (1, 4) for z in (2, 5)]
    assert best == pytest.approx(min(every))
    assert best == pytest.approx(clients._ring_ms([peers["p0"], peers["p1"], peers["p2"]]))  # all in one region


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_the_oracle_is_the_cheapest_ring_of_every_chain_of_spans(data):
    """Any spans (auto placement's too), peers in any regions, some behind a relay: the
    oracle's price is the cheapest ring over every chain of spans from layer 0 to the
    last, among its ORACLE_HEADS heads, tried one by one."""
    from types import SimpleNamespace

    from meshnet_p2p.sim.clients import ORACLE_HEADS, Clients
    from meshnet_p2p.sim.net import REGIONS
    from meshnet_p2p.sim.records import N_LAYER
    from meshnet_p2p.swarm.placement import Span

    net = SimNetwork(random.Random(data.draw(st.integers(0, 1000))), NetModel(loss=0.0))
    cuts = data.draw(st.lists(st.integers(1, N_LAYER - 1), max_size=3, unique=True).map(sorted))
    bounds = [0, *cuts, N_LAYER]
    n = data.draw(st.integers(1, 9))
    peers, spans = {}, []
    relays = [SimpleNamespace(host=net.host(region=r)) for r in REGIONS[:2]]
    for i in range(n):
        a, b = sorted(data.draw(st.lists(st.sampled_from(bounds), min_size=2, max_size=2, unique=True)))
        relay = data.draw(st.sampled_from([None, *relays]))
        peers[f"p{i}"] = SimpleNamespace(host=net.host(region=data.draw(st.sampled_from(REGIONS))), relay=relay,
                                         compute_ms=data.draw(st.floats(0.5, 50.0)))
        spans.append(Span(f"p{i}", a, b))
    clients = Clients(SimpleNamespace(net=net, m=None, rng=None, cfg=SimpleNamespace(probe=False, seed=1)))

    heads = sorted((s for s in spans if s.start == 0), key=lambda s: peers[s.peer_id].compute_ms)[:ORACLE_HEADS]
    rings = []

    def chains(chain):
        if chain[-1].end == N_LAYER:
            rings.append(clients._ring_ms([peers[s.peer_id] for s in chain]))
            return
        for s in spans:
            if s.start == chain[-1].end and s not in chain:
                chains(chain + [s])

    for head in heads:
        chains([head])
    best = clients._oracle_ms(spans, peers)
    if rings:
        assert best == pytest.approx(min(rings), rel=1e-9)
    else:
        assert best is None


@pytest.mark.parametrize("minutes", [0.5, 1.0, 10.0])
async def test_surveys_start_early_enough_to_end_in_the_window_and_as_many_as_over_all_of_it(minutes, autojump_clock):
    """The window's surveys are the arrivals of the whole window's Poisson stream, each
    earlier by the window's ratio: none in its last SURVEY_LEAD_S (half of a short
    one), and the run waits for every one started, and every lookup, to end."""
    from types import SimpleNamespace

    from meshnet_p2p.sim.clients import SURVEY_LEAD_S, Clients

    cfg = SimpleNamespace(probe=False, seed=5, surveys_per_s=0.5, procs=1)
    window = minutes * 60
    whole, s0 = [], trio.current_time()
    async for rng in Clients(SimpleNamespace(m=None, cfg=cfg))._poisson("surveys", cfg.surveys_per_s, s0 + window):
        whole.append(trio.current_time() - s0)
        rng.randrange(2)  # (each arrival's own choice: its model)
    started, ended = [], []
    async with trio.open_nursery() as nursery:
        sim = SimpleNamespace(m=None, cfg=cfg, tasks=nursery, models=["a", "b"], me=0)
        clients = Clients(sim)

        async def survey(model: int) -> None:
            started.append(trio.current_time() - t0)
            await trio.sleep(20.0)
            ended.append(trio.current_time() - t0)

        clients._survey = survey
        t0 = trio.current_time()
        await clients.surveys(t0 + window)
        await clients.reported()
        assert len(ended) == len(started)
    lead = min(SURVEY_LEAD_S, window / 2)
    assert started == pytest.approx([t * (window - lead) / window for t in whole])
    assert len(started) > 5 and max(started) < window - lead


# a swarm whose honest peers cover every slice throughout (few leave, most serve):
# with a slice uncovered, the liars' whole-model claims are all there is ("no live route")
LIARS = dict(SMALL, models=1, volunteer_share=0.8, churn=Churn(session_median_s=36_000.0, gap_median_s=60.0),
             sybils=6, sybil_behaviour="liar")


def test_liars_claiming_the_whole_model_cost_fresh_clients_first_contacts_not_the_route():
    """Identities announcing the target model's whole span, fast, at addresses
    nobody answers on: every fresh client's route search that plans without probing
    first (the production planner and its widening first contacts) tries them first,
    sets each aside, and still reaches the honest route."""
    doc = simulate(SimConfig(**LIARS, probe=False))
    assert doc["target_surveys"] >= 5
    routed = doc["target_survey_outcomes"].get("route", 0)
    assert routed >= 0.7 * doc["target_surveys"], doc["target_survey_outcomes"]
    assert doc["target_failed_contacts_mean"] >= 5  # each liar was planned and tried
    assert doc["target_contact_rounds_p90"] >= 2  # side by side after the first failure
    assert doc["target_route_quality_p50"] >= 1.0  # the oracle's ring is never beaten


def test_a_probe_before_the_first_plan_spares_fresh_clients_the_liars_made_up_addresses():
    """The same swarm, the search probing its candidates first (route/probe.py, as
    production does): the liars' addresses never accept, so no first contact goes to
    them and the route opens in one round."""
    doc = simulate(SimConfig(**LIARS))
    assert doc["target_surveys"] >= 5
    assert doc["target_survey_outcomes"].get("route", 0) >= 0.7 * doc["target_surveys"], doc["target_survey_outcomes"]
    assert doc["target_failed_contacts_mean"] <= 1.0, doc  # against >= 5 without the probe (above)
    assert doc["target_contact_rounds_p90"] <= 1, doc
    assert doc["target_route_quality_p50"] >= 1.0


def test_a_certifiers_verdicts_spare_fresh_clients_the_liars():
    """With the certifier vouching for the volunteers it audited (review's verdicts, the
    real record), a fresh client's planner prefers them (api.py's ``prefer``): the
    liars' whole-model claims cost it no first contact once the verdicts are out."""
    steady = Churn(session_median_s=36_000.0, gap_median_s=60.0)
    doc = simulate(SimConfig(**{**SMALL, "models": 1, "volunteer_share": 0.8, "churn": steady}, sybils=6,
                             sybil_behaviour="liar", verdicts=True))
    assert doc["target_surveys"] >= 5 and doc["target_route_found"] >= 0.7, doc
    assert doc["target_vouched_mean"] >= 3, doc
    assert doc["target_failed_contacts_mean"] <= 1.0, doc  # against >= 5 without verdicts (above)


def test_ground_identities_share_the_key_s_top_bits():
    from meshnet_p2p.dht.routing import node_id_of
    from meshnet_p2p.sim.sybil import grind

    target = random.Random(4).getrandbits(256)
    found = grind(target, 3, 8, random.Random(5))
    assert len({str(i.peer_id) for i in found}) == 3
    assert all((node_id_of(i.peer_id) ^ target) >> 248 == 0 for i in found)


def test_the_simulation_runs_the_production_gossip(small, monkeypatch):
    """A change in a protocol core changes what the simulation measures: with
    gossip.py (by refresh.py) pushing every re-announcement again (what it did before the
    simulator's first finding, docs/scale.md), each node pushes several times as much."""
    ours = small["requests_per_node_s"].get("gossip_push", 0.0)
    monkeypatch.setattr(refresh, "_same_but", lambda a, b, volatile: False)
    before = simulate(SimConfig(**SMALL, **WITH))["requests_per_node_s"]["gossip_push"]
    assert before > 2 * ours, (before, ours)


def test_requests_are_counted_from_when_measuring_began():
    """A node online when measuring began counts only what it sent since, for every
    kind (an early version subtracted its start for one kind only), requests and
    their bytes, asked and answered."""
    from collections import Counter
    from types import SimpleNamespace

    from meshnet_p2p.sim.swarm import SimSwarm

    sim = SimSwarm(SimConfig(peers=2))
    node = SimpleNamespace(stats=Counter(sent_ping=5, sent_store=2, timeouts=1, bytes_sent_ping=500,
                                         bytes_answered_gossip_pull=3000),
                           store=SimpleNamespace(full_key_refused=3, full_key_replaced=1))
    sim._kinds_at_start[id(node)] = {**node.stats, "full_key_refused": 3, "full_key_replaced": 1}
    node.store.full_key_refused += 4
    node.stats.update(sent_ping=2, sent_store=1, sent_gossip_pull=4, bytes_sent_ping=200, bytes_sent_store=700,
                      bytes_answered_gossip_pull=1000, bytes_answered_ping=150)
    sim.measuring = True
    sim._count(node)
    assert sim.kinds == Counter(ping=2, store=1, gossip_pull=4)
    assert sim.kind_bytes == Counter({("ping", "asks"): 200, ("store", "asks"): 700,
                                      ("gossip_pull", "answers"): 1000, ("ping", "answers"): 150})
    assert sim.full_key == Counter(full_key_refused=4, full_key_replaced=0)  # a store's full-key counts too


def test_a_lookup_that_misses_volunteers_reports_where_their_records_are(monkeypatch):
    """bench/sim.py at 3,000 peers, one model (~840 volunteers, a home keeps 256 a key):
    lookups missed a few volunteers, the same ones again and again. The report now says
    where the missed records were (how many nodes held each, the rank from the key of
    the nearest) and how often stores met a full key, so a fix can be measured.
    Here a home keeps 4 values a key, under ~20 volunteers of one model: those missed
    are refused everywhere (held by none)."""
    import functools

    import meshnet_p2p.dht.node as node_mod
    from meshnet_p2p.dht.storage import ValueStore

    monkeypatch.setattr(node_mod, "ValueStore", functools.partial(ValueStore, max_values_per_key=4))
    steady = Churn(session_median_s=36_000.0, gap_median_s=60.0)
    doc = simulate(SimConfig(**{**SMALL, "models": 1, "volunteer_share": 0.8, "churn": steady}))
    assert doc["model_lookup_complete"] < 1.0 and doc["model_lookup_missed"] > 0, doc
    assert 1 <= doc["model_lookup_missed_volunteers"] <= doc["model_lookup_missed"]
    held = doc["model_lookup_missed"] - doc["model_lookup_missed_unheld"]
    assert (held == 0) == (doc["model_lookup_missed_nearest_rank_p50"] is None), doc
    assert doc["full_key_stores_per_node_s"]["refused"] > 0, doc


def test_where_a_missed_volunteers_record_is_held_is_ranked_by_distance_from_the_key():
    """The oracle behind the report above: among the DHT's servers online (NATed
    peers serve no DHT requests), the holders of a missed record, nearest the key first."""
    from types import SimpleNamespace

    from meshnet_p2p.dht.routing import key_id
    from meshnet_p2p.sim.clients import Clients
    from meshnet_p2p.swarm.capability import model_key

    target = key_id(model_key("ab" * 32).encode())
    a, b = (SimpleNamespace(multihash=bytes([i])) for i in (1, 2))
    holds = {0: set(), 1: {a.multihash}, 2: set(), 3: {a.multihash}, 4: {a.multihash, b.multihash}}

    def peer(rank: int, natted: bool = False):
        store = SimpleNamespace(expires_at=lambda key, signer: 1 if signer in holds[rank] else None)
        return SimpleNamespace(host=SimpleNamespace(natted=natted), node=SimpleNamespace(node_id=target ^ (rank + 1), store=store))

    peers = [peer(3), peer(1), peer(0), peer(4, natted=True), peer(2)]  # the NATed one is no server
    sim = SimpleNamespace(models=["ab" * 32], online=lambda sybils=False: peers, m=None,
                          cfg=SimpleNamespace(probe=True, seed=1))
    got = Clients(sim)._where_held(0, [a, b])
    assert sorted(got, key=lambda x: x["signer"]) == sorted([
        {"signer": str(a), "holders": 2, "nearest_rank": 1},  # ranks 1 and 3 of servers 0-3
        {"signer": str(b), "holders": 0, "nearest_rank": None}], key=lambda x: x["signer"])


def test_liars_squatting_a_slice_cannot_empty_it_under_auto_placement():
    """Ten identities on one /24, in place before the swarm forms, claim layers 0-9 at ten
    times an honest rate, at an address nobody answers on. Volunteers placed by `join
    --layers auto`'s own code (swarm.placing) must still cover those layers: before the
    fix every volunteer avoided them and no fresh client found a route."""
    steady = Churn(session_median_s=36_000.0, gap_median_s=60.0)
    doc = simulate(SimConfig(**{**SMALL, "models": 1, "volunteer_share": 0.8, "churn": steady}, placement="auto",
                             sybils=10, sybil_behaviour="liar", sybil_layers=(0, 10), surveys_per_s=0.6))
    assert doc["target_hole_share"] == 0.0, doc
    assert doc["target_cover_min_mean"] >= 0.5 * doc["target_cover_mean"], doc  # and evenly
    assert doc["target_surveys"] >= 5 and doc["target_route_found"] >= 0.7, doc


async def test_a_generation_fails_over_when_a_hop_leaves_and_completes(autojump_clock):
    """The simulated generation steps a ring token by token; a hop whose peer leaves fails
    the next step, and the client's failover (a fresh look, the route search for exactly
    that hop's layers, a replay) carries it to its last token, one failover spent; a hop
    whose machine vanished costs the step its timeout first. With no peer left for those
    layers, the generation ends saying so."""
    from types import SimpleNamespace

    from meshnet_p2p.route.options import RouteOptions
    from meshnet_p2p.sim.clients import FIRST_CONTACT_RTTS, REPLAY_SPEEDUP, Clients
    from meshnet_p2p.sim.records import SLICES
    from meshnet_p2p.swarm.placement import Span

    net = SimNetwork(random.Random(1), NetModel(loss=0.0))
    layout = {"head": SLICES[0], "mid": SLICES[1], "tail": SLICES[2], "twin": SLICES[1]}
    peers = {name: SimpleNamespace(identity=SimpleNamespace(peer_id=name), host=net.host(region="eu"), relay=None,
                                   layer_ms=1.0, compute_ms=10.0, node=object(), sybil=None, model=0, vanished=False)
             for name in layout}
    sim = SimpleNamespace(net=net, by_id=peers, cfg=SimpleNamespace(generation_tokens=50, relays=0, bad_relays=0, probe=True, seed=1), m=None, rng=None,
                          online=lambda: [p for p in peers.values() if p.node is not None])
    clients = Clients(sim)
    spans = [Span(name, a, b, 100.0 if name != "twin" else 10.0) for name, (a, b) in layout.items()]
    looks = []

    async def look(model, host):  # a fresh survey: the reports of the peers still online
        looks.append(trio.current_time())
        return [s for s in spans if peers[s.peer_id].node is not None], len(spans), 1, frozenset()

    clients._look = look
    client = net.host(region="eu")

    async def generate(leaving: list[str]) -> dict:
        search = clients._search(spans)
        opened = await clients._open(search, 0, 30, clients._answering(), client, spend=False)
        route = opened["route"]
        assert [s.peer_id for s in route] == ["head", "mid", "tail"]  # the twin claims less
        token_s = clients._ring_ms([peers[s.peer_id] for s in route]) / 1000
        entry: dict = {}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(clients._generate, 0, client, search, route, entry)
            await trio.sleep(token_s * 10.5)
            for name in leaving:  # after ten tokens
                peers[name].node = None
        return entry, token_s

    entry, token_s = await generate(["mid"])
    assert entry["generation"] == "complete" and entry["failovers"] == 1, entry
    assert len(looks) == 1
    replay_s = 10 * (1 + 10 / REPLAY_SPEEDUP) / 1000  # the twin's 10 layers, for the 10 positions so far
    after_s = clients._ring_ms([peers["head"], peers["twin"], peers["tail"]]) / 1000
    # the replacement's first contact: one round, the twin alone serving the layers
    contact_s = FIRST_CONTACT_RTTS * 2 * clients._client_link_s(client, peers["twin"])
    # ten tokens, the eleventh's step that failed, the first contact, the replay, the forty left on the new ring
    assert entry["generation_s"] == pytest.approx(11 * token_s + contact_s + replay_s + 40 * after_s)
    assert entry["stalled_s"] == 0

    # a hop whose machine vanished (no FIN): the step that fails waits out the client's step timeout
    peers["mid"].node, peers["mid"].vanished = object(), True
    entry, token_s = await generate(["mid"])
    assert entry["generation"] == "complete" and entry["stalled_s"] == pytest.approx(RouteOptions.step_timeout - token_s)
    assert entry["generation_s"] == pytest.approx(10 * token_s + RouteOptions.step_timeout + contact_s + replay_s
                                                  + 40 * after_s)
    peers["mid"].vanished = False

    peers["mid"].node = object()
    entry, _ = await generate(["mid", "twin"])
    assert entry["generation"] == "failover: no live route" and entry["failovers"] == 1, entry


def test_a_peer_holds_the_gossip_of_the_topics_it_follows_not_the_swarms(small):
    """docs/scale.md: every node held and pulled every peer's reports, so bytes a
    node and the simulator's memory grew with the swarm. With four models a
    volunteer's node holds its own model's reports (and a client's nothing)."""
    ours = small["gossip_held_mean"]
    every = simulate(SimConfig(**SMALL, **WITH, dht=DHTConfig(follow_all=True)))["gossip_held_mean"]
    assert every > 3 * ours, (every, ours)


def test_the_default_window_measures_as_many_peer_minutes_at_any_size():
    """bench/sim.py's window when none is given: ten minutes up to 1,000 peers (the
    figures before 2026-12-06), one at 10,000, never under one; the warm-up two minutes
    up to 1,000 peers and one beyond. (Sound since nodes draw the phases of their
    periodic work: tests/test_dht.py, "start together".)"""
    from meshnet_p2p.sim.swarm import default_window
    assert default_window(40) == (10.0, 2.0)
    assert default_window(1000) == (10.0, 2.0)
    assert default_window(2000) == (5.0, 1.0)
    assert default_window(10_000) == (1.0, 1.0)
    assert default_window(50_000) == (1.0, 1.0)
    for n in (1, 999, 1001, 3000, 7777, 10_001):
        measured, warmup = default_window(n)
        assert 1.0 <= measured <= 10.0 and warmup in (1.0, 2.0)
        assert measured * n == 10_000 or measured in (1.0, 10.0)


def _halves(body, lookahead_s=None):
    """``body(net, partner)`` in two threads, each its own trio run on a mock clock: the
    two processes of a split run, linked as split.py links them, on one network of
    hosts both know (made before, as a split run forks after drawing its swarm)."""
    import socket
    import threading

    from meshnet_p2p.sim.split import LOOKAHEAD_S, Partner

    socks = socket.socketpair()
    results, errors = [None, None], []

    def half(me: int) -> None:
        net = SimNetwork(random.Random(1), NetModel(loss=0.0))
        hosts = [net.host(region=r) for r in ("na", "eu", "eu")]
        for i, h in enumerate(hosts):
            net.owner[h.addr] = i % 2
        net.me = me
        net.partner = Partner(socks[me], me, lookahead_s or LOOKAHEAD_S)

        async def main():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(net.run)
                done = trio.Event()

                async def meet():
                    await net.partner.run(net, lambda *change: None)
                    done.set()

                nursery.start_soon(meet)
                results[me] = await body(net, hosts)
                net.partner.wants_end = lambda: True
                await done.wait()
                nursery.cancel_scope.cancel()

        try:
            trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
        except BaseException as e:  # (seen by the test, not lost in the thread)
            errors.append(e)
            socks[me].close()  # the other half then ends too

    threads = [threading.Thread(target=half, args=(me,), daemon=True) for me in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a half never ended"
    return results, errors


def test_a_datagram_to_the_other_half_of_a_split_run_arrives_at_its_time_and_its_answer_too():
    """split.py: host 0 (process 0, NA) asks host 1 (process 1, EU), which answers: each
    arrives at its one-way delay, as in one process, though the two clocks run apart
    between the points where the halves meet."""
    async def body(net, hosts):
        a, b = hosts[0], hosts[1]
        one_way = net.one_way_s(a, b)
        if net.me == 0:
            t = net.attach(a)
            await t.send(b"question", b.addr)
            got = await t.receive()
            return got, trio.current_time(), one_way
        t = net.attach(b)
        data, src = await t.receive()
        at = trio.current_time()
        await t.send(b"answer to " + data, src)
        return (data, src), at, one_way

    (asked, answered), errors = _halves(body)
    assert not errors
    (got, t_back, one_way), ((data, src), t_there, _) = asked, answered
    assert one_way <= t_there < one_way + 0.001  # at the tick it falls in, as in one process
    assert 2 * one_way <= t_back < 2 * one_way + 0.002
    assert data == b"question" and got[0] == b"answer to question"


def test_a_datagram_faster_than_the_lookahead_is_refused_not_delivered_late():
    async def body(net, hosts):
        if net.me == 0:
            await net.attach(hosts[0]).send(b"too fast", hosts[1].addr)

    _, errors = _halves(body, lookahead_s=1.0)  # a lookahead longer than the NA-EU delay
    assert any("under the split run's lookahead" in repr(e) for e in errors), errors


def test_a_run_split_over_two_processes_finds_what_one_finds():
    """bench/sim.py's default on two cores: half the peers in each process (split.py).
    A lookup from either half finds the volunteers of both (recall against the whole
    swarm), node lookups find nodes of both, fresh clients route and generate, and the
    report adds up both halves' traffic."""
    cfg = dict(SMALL, models=1, volunteer_share=0.8, churn=Churn(session_median_s=120.0, gap_median_s=120.0))
    doc, one = simulate(SimConfig(**cfg, procs=2)), simulate(SimConfig(**cfg))
    assert doc["procs"] == 2 and doc["model_lookups"] > 10 and doc["model_lookup_recall_mean"] >= 0.95, doc
    assert len(doc["split_waited_s"]) == 2 and "split_waited_s" not in one  # (each half's wait for the other)
    assert doc["node_lookups"] > 5 and doc["node_lookup_success"] >= 0.9, doc
    assert doc["surveys"] > 3 and doc["route_found"] == 1.0 and doc["generated"] == 1.0, doc
    # who is online when is the seed's, in one process or two (a half sees the other's
    # peers at most a lookahead late: the samples may differ by a peer)
    assert doc["joins"] + doc["leaves"] > 0 and (doc["joins"], doc["leaves"]) == (one["joins"], one["leaves"])
    assert doc["online_mean"] == pytest.approx(one["online_mean"], abs=1.0)
    assert 0.7 < doc["messages_per_node_s"] / one["messages_per_node_s"] < 1.4, (doc, one)


def test_a_split_run_refuses_relays_and_more_than_two_processes():
    with pytest.raises(ValueError, match="relays"):
        simulate(SimConfig(**SMALL, relays=2, procs=2))
    with pytest.raises(ValueError, match="1 or 2"):
        simulate(SimConfig(**SMALL, procs=3))
