"""Issue 24 #0 and #3: records that kill a node's gossip, loops that end a
process, and a DHT node filled from one host. Fake network, virtual time."""

import os
from collections import Counter

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st
import trio
import trio.testing

from meshnet_p2p.swarm.capability import model_key
from meshnet_p2p.trust.evidence import index_key, sign_index
from meshnet_p2p.dht import wire
from meshnet_p2p.dht.gossip import DIGEST_BUDGET_BYTES, GossipState
from meshnet_p2p.dht.node import STORE_BURST, STORE_RATE_PER_S, DHTNode, Request
from meshnet_p2p.nat.dialer import serve_dial_backs
from meshnet_p2p.dht.storage import ValueStore
from meshnet_p2p.core.identity import Identity, PeerId
from meshnet_p2p.swarm.node import TYPES, UNANNOUNCED_LIFETIME_MS, lifetime_cap
from meshnet_p2p.core.records import Record, RecordVerifier, wall_ms
from meshnet_p2p.testing import FakeNetwork, sample_report, start_swarm, swarm_identity


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


def cert_index(ident: Identity, model: str | None = None) -> tuple[str, bytes]:
    """A certifier index naming any model (what the flood stores): ~122-char key."""
    model = model or os.urandom(32).hex()
    return index_key(model, str(ident.peer_id)), sign_index(ident, model, [], now_ms=wall_ms())


def volunteer_report(ident: Identity, model: str) -> tuple[str, bytes]:
    now = wall_ms()
    return model_key(model), sample_report(ident, model).sign(ident, seq=now, now_ms=now, ttl_ms=120_000)


# --- 0. 500 long-key records, and the pull's digest ------------------------------------------------


async def test_a_node_holding_500_long_key_records_keeps_running_and_its_pulls_deliver(autojump_clock):
    """Issue 24 #0: 500 certifier-index records (fresh identity each) stored on a
    node made its gossip pull's digest ~70 KB; wire.encode raised and ended
    DHTNode.run, and the whole process (seen failing: the ValueError
    'gossip_pull datagram of ... bytes exceeds 60000' out of the nursery)."""
    async with trio.open_nursery() as nursery:
        net, nodes = await start_swarm(nursery, 6, TYPES)
        victim, flooders = nodes[0], nodes[1:5]
        accepted = 0
        for i in range(500):
            key, rec = cert_index(swarm_identity(50_000 + i))
            reply = await flooders[i % 4].request(victim.contact(), "store", {"key": key, "record": rec})
            accepted += bool(reply and reply.body["ok"])
        assert accepted == 500
        # a newcomer that knows only the victim gets all of it by pulls (pushes went out before it came)
        newcomer = DHTNode(swarm_identity(99), net.endpoint(), TYPES)
        await nursery.start(newcomer.run)
        await newcomer.bootstrap([victim.contact()])
        for _ in range(600):
            if sum(len(t) for t in newcomer.gossip.topics.values()) >= 500:
                break
            await trio.sleep(1)
        assert sum(len(t) for t in newcomer.gossip.topics.values()) >= 500
        for node in [*nodes, newcomer]:
            assert not any(k.startswith(("loop_errors_", "unsendable_")) for k in node.stats), dict(node.stats)
            assert node.stats["sent_gossip_pull"] > 0
        assert await newcomer.ping(victim.contact()) is not None  # still serving
        nursery.cancel_scope.cancel()


def test_digest_pages_fit_a_datagram_and_every_topic_comes_round():
    """Bounded in bytes, not entries; rotated, so successive pulls cover every
    topic (not the same first 400 entries every time)."""
    state = GossipState()
    now = wall_ms()
    idents = [Identity.from_seed(i.to_bytes(32, "big")) for i in range(1, 9)]
    topics = [f"certs/{i:064x}/{'x' * 52}" for i in range(1000)]
    for n, topic in enumerate(topics):
        for ident in idents[: 1 + n % 8]:
            state.topics.setdefault(topic, {})[ident.peer_id.multihash] = Record(
                "t", {"key": topic}, 7, now, now + 60_000, ident.peer_id, b"", b"w")
    covered, pages, wrapped = set(), 0, False
    while not wrapped:
        have, after, upto = state.digest()
        pages += 1
        assert pages < 50
        body = {"have": have, **({"after": after} if after else {}), **({"upto": upto} if upto else {})}
        assert len(msgpack.packb(have, use_bin_type=True)) <= DIGEST_BUDGET_BYTES
        assert len(wire.encode(idents[0], "gossip_pull", wire.new_rpc_id(), {**body, "cookie": b"c" * 16}, now,
                               to=idents[1].peer_id)) < wire.MAX_DATAGRAM
        for t in have:
            assert (after is None or t > after) and (upto is None or t <= upto)
            assert have[t] == {s[-8:]: 7 for s in state.topics[t]}  # whole topics: nothing re-sent needlessly
        covered |= set(have)
        wrapped = upto is None
    assert covered == set(topics) and pages > 2
    # a peer answers only within the page's range: what it holds outside is for another page
    peer = GossipState()
    peer.topics = {t: dict(state.topics[t]) for t in topics}
    have, after, upto = state.digest()
    assert after is None and upto is not None
    assert peer.missing_from(have, budget=1 << 30, now_ms=now, after=after, upto=upto) == []
    extra = Record("t", {"key": topics[0]}, 8, now, now + 60_000, idents[7].peer_id, b"", b"new")
    peer.topics[topics[0]][idents[7].peer_id.multihash] = extra
    peer.topics[topics[-1]][idents[7].peer_id.multihash] = extra  # (beyond this page: not sent now)
    assert peer.missing_from(have, budget=1 << 30, now_ms=now, after=after, upto=upto) == [extra]


async def test_a_datagram_too_big_to_send_is_a_counted_drop_not_the_end_of_the_node(autojump_clock):
    async with trio.open_nursery() as nursery:
        _, (a, b) = await start_swarm(nursery, 2, TYPES)
        assert await a.request(b.contact(), "find_value", {"key": "k" * 70_000}) is None  # ours: never sent
        assert a.stats["unsendable_find_value"] == 1
        # an answer that cannot be encoded: the asker times out, the answerer goes on
        b._handle = lambda msg, addr: ("pong", {"blob": b"x" * 70_000})
        assert await a.ping(b.contact()) is None
        assert b.stats["unsendable_pong"] == 1
        del b._handle
        assert await a.ping(b.contact()) is not None
        nursery.cancel_scope.cancel()


# --- 0. every background loop isolated ---------------------------------------------------------------


class Boom(RuntimeError):
    pass


def boom(*args, **kwargs):
    raise Boom("injected")


async def aboom(*args, **kwargs):
    raise Boom("injected")


@pytest.mark.parametrize("target, loop", [
    ("_gossip_pull", "gossip_pull"),  # the pull loop's iteration
    ("_maintain", "maintenance"),  # the maintenance loop's iteration
    ("_handle", "receive"),  # one datagram's handling
])
async def test_a_loop_that_throws_every_iteration_is_counted_and_the_node_runs_on(autojump_clock, target, loop):
    async with trio.open_nursery() as nursery:
        _, (a, b) = await start_swarm(nursery, 2, TYPES)
        setattr(b, target, aboom if target != "_handle" else boom)
        with trio.move_on_after(120):
            while b.stats["loop_errors_" + loop] < 3:
                if target == "_handle":
                    await a.ping(b.contact())
                await trio.sleep(1)
        assert b.stats["loop_errors_" + loop] >= 3
        delattr(b, target)
        assert await a.ping(b.contact()) is not None  # still serving
        assert await b.ping(a.contact()) is not None
        nursery.cancel_scope.cancel()


async def test_a_loop_failing_every_time_backs_off_rather_than_spins(autojump_clock):
    async with trio.open_nursery() as nursery:
        _, (a, b) = await start_swarm(nursery, 2, TYPES)
        b._gossip_pull = aboom
        await trio.sleep(120)  # at one pull a second, 120 failures without backoff
        assert 3 <= b.stats["loop_errors_gossip_pull"] <= 15
        del b._gossip_pull
        before = b.stats["sent_gossip_pull"]
        await trio.sleep(60)  # one good iteration resets the backoff
        assert b.stats["sent_gossip_pull"] - before >= 20
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("task, loop", [
    ("push", "push"),  # a gossip push task
    ("verify", "verify_contact"),  # pinging a new address before it enters the table
    ("stale", "check_stale"),  # pinging a stale table member
    ("dial", "dial_back"),  # a dial-back job
])
async def test_a_background_task_that_throws_is_counted_and_the_node_runs_on(autojump_clock, task, loop):
    async with trio.open_nursery() as nursery:
        _, (a, b) = await start_swarm(nursery, 2, TYPES)
        if task == "push":
            b.request = aboom
            b._gossip_in(cert_index(swarm_identity(7))[1], from_peer=None)
        elif task == "verify":
            b.ping = aboom
            b._verify_later(a.peer_id, ("10.9.9.9", 4001))
        elif task == "stale":
            b.ping = aboom
            b._check_later(a.contact())
        else:
            server = serve_dial_backs(b, None)
            server._result_record = boom
            msg = wire.Message("dial_back", wire.new_rpc_id(), a.peer_id, wall_ms(), {})
            b.start_soon(server._job, Request(msg, a.addr, 100, True), [("/ip4/10.0.0.1/tcp/1", False, "x")],
                         b"n" * 16, [False])
        await trio.sleep(2)
        assert b.stats["loop_errors_" + loop] == 1
        for name in ("request", "ping"):
            b.__dict__.pop(name, None)
        assert b._pushing == 0 and not b._verifying and not b._pinging
        assert task != "dial" or server.dials_in_flight == 0
        assert await a.ping(b.contact()) is not None
        nursery.cancel_scope.cancel()


async def test_cancellation_and_keyboard_interrupt_still_pass_through_a_guard(autojump_clock):
    from meshnet_p2p.core.guard import Guard

    guard = Guard("x", None)
    with trio.move_on_after(1) as scope:
        async with guard:
            await trio.sleep_forever()
    assert scope.cancelled_caught and guard.total == 0
    with pytest.raises(KeyboardInterrupt):
        async with guard:
            raise KeyboardInterrupt
    async with guard:
        raise Boom("counted")
    assert guard.total == 1


# --- 3. a node filled from one host ------------------------------------------------------------------


def verified(wire_record: bytes) -> Record:
    return RecordVerifier(TYPES).verify(wire_record, wall_ms(), remember=False)


def test_a_flood_from_one_network_leaves_room_for_a_volunteer_and_a_certifier():
    """Issue 24 #3: ~1,600 identities storing 64 certifier indexes each filled a
    node (100,000 values) from one host; it then refused every new (key,
    signer): "this node's store is full". Scaled down: a 2,000-value node, the
    flood from one source (seen failing on the old code: both refused)."""
    now = wall_ms()
    store = ValueStore(max_values=2000)
    flooded = 0
    for i in range(2000 // 64 + 1):
        ident = swarm_identity(100_000 + i)
        for _ in range(64):
            key, rec = cert_index(ident)
            flooded += store.put(key, verified(rec), now, source="198.51.100.0/24")[0]
    assert len(store) == 2000 and flooded >= 2000
    model = "ab" * 32
    key, rec = volunteer_report(swarm_identity(7), model)
    assert store.put(key, verified(rec), now, source="203.0.113.0/24") == (True, "stored")
    key, rec = cert_index(swarm_identity(8), model)
    assert store.put(key, verified(rec), now, source="192.0.2.0/24") == (True, "stored")
    # the flooder makes room for itself only from itself: never from the others
    key, rec = cert_index(swarm_identity(9))
    assert store.put(key, verified(rec), now, source="198.51.100.0/24")[0] is False
    assert store.sources()["203.0.113.0/24"] == 1 and store.sources()["192.0.2.0/24"] == 1
    assert len(store) == 2000


def test_the_homes_of_a_full_key_make_room_from_different_volunteers():
    """bench/sim.py, one model of ~840 volunteers, a home keeping 256 a key: each home
    made room for a live newcomer by dropping the value soonest to expire, so every
    home near the key dropped the same volunteers (the first to announce, held
    longest without a renewal), and lookups missed them again and again. Each home
    now drops by its own order of signers; floods still go first (the test above)."""
    model, now = "ab" * 32, wall_ms()
    key = model_key(model)

    def report(i: int, ttl_ms: int) -> Record:
        ident = swarm_identity(40_000 + i)
        return verified(sample_report(ident, model).sign(ident, seq=1, now_ms=now, ttl_ms=ttl_ms))

    held = [report(i, 60_000 + 1000 * i) for i in range(8)]  # the first expires soonest
    newcomer = report(99, 120_000)
    dropped = []
    for home in range(16):
        store = ValueStore(max_values_per_key=8, _salt=bytes([home]) * 16)
        for i, rec in enumerate(held):
            assert store.put(key, rec, now, source=f"net-{i}")[0]  # each volunteer from its own network
        assert store.put(key, newcomer, now, source="net-99",
                         live=lambda r: r.signer == newcomer.signer) == (True, "stored")
        (gone,) = {r.signer for r in held} - {r.signer for r in store.get(key, now, budget=1 << 30)[0]}
        dropped.append(gone)
    assert len(set(dropped)) >= 4, Counter(dropped)  # (all 16 dropped the first before)


def test_one_network_holds_at_most_its_budget_across_keys_and_a_fair_share_is_never_refused():
    now = wall_ms()
    store = ValueStore(max_values=1000, max_values_per_network=300)
    got = {}
    for net in ("a", "b", "c", "d"):  # four networks, 400 each: 300 stored each until the node is full
        got[net] = 0
        for i in range(400):
            key, rec = cert_index(swarm_identity(200_000 + i))
            got[net] += store.put(key, verified(rec), now, source=net)[0]
    assert got["a"] == 300 and len(store) == 1000
    assert max(store.sources().values()) <= 300
    assert min(store.sources().values()) >= 1000 // 4 - 1  # the late networks took room from the first ones
    # the bookkeeping holds only what is held
    store.expire(now + 25 * 3600 * 1000)
    assert len(store) == 0 and store.sources() == {} and not store._keys_of_signer and not store._meta
    assert store._top == 0 and not store._by_count and store._bytes == 0 and not store._bytes_of_source
    # and in bytes: a network's big records count by their size, and so does the node's total
    key, rec = cert_index(swarm_identity(1))
    size = len(rec)
    store = ValueStore(max_bytes_per_network=10 * size + size // 2, max_bytes=15 * size + size // 2)
    stored = {"a": 0, "b": 0}
    for net in stored:
        for i in range(12):
            key, rec = cert_index(swarm_identity(210_000 + i))
            assert len(rec) == size
            stored[net] += store.put(key, verified(rec), now, source=net)[0]
    # a: 10 (its byte budget); b: 5 in the room left, then 3 more taken from a, down to a fair share
    assert stored == {"a": 10, "b": 8} and store.sources() == {"a": 7, "b": 8} and store._bytes == 15 * size


def test_values_for_a_model_nobody_announces_live_minutes_and_go_first():
    now = wall_ms()
    store = ValueStore(max_values=3)
    holds = {model_key("cd" * 32)}
    announced = lambda key: key in holds  # noqa: E731
    model = "cd" * 32
    key, rec = cert_index(swarm_identity(1), model)
    assert lifetime_cap(key, announced) is None
    store.put(key, verified(rec), now, source="n1", lifetime_cap_ms=lifetime_cap(key, announced))
    junk = []
    for i in range(2):
        k, r = cert_index(swarm_identity(10 + i))
        cap = lifetime_cap(k, announced)
        assert cap == UNANNOUNCED_LIFETIME_MS
        assert store.put(k, verified(r), now, source="n1", lifetime_cap_ms=cap)[0]
        junk.append(k)
        assert store.expires_at(k, swarm_identity(10 + i).peer_id.multihash) == now + UNANNOUNCED_LIFETIME_MS
    # full: a record that lives its whole life displaces a short-lived one, even from a smaller network
    k2, r2 = volunteer_report(swarm_identity(20), model)
    assert store.put(k2, verified(r2), now, source="n1") == (True, "stored")
    assert sum(store.holds(k, now) for k in junk) == 1 and store.holds(key, now)
    later = now + UNANNOUNCED_LIFETIME_MS + 1
    store.expire(later)
    assert not any(store.holds(k, later) for k in junk) and store.holds(key, later)  # (it lives its day)
    assert lifetime_cap("model/" + "cd" * 32, announced) is None and lifetime_cap("relays", announced) is None


async def test_a_store_flood_over_udp_is_rate_limited_per_network_and_others_still_store(autojump_clock):
    """Over the wire: stores from one network past a burst are refused before
    any signature check; a crowd of honest peers behind one address (16
    volunteers storing two records each, at once) is not."""
    async with trio.open_nursery() as nursery:
        clock = {"now": wall_ms()}  # the buckets' clock stands still unless moved
        net = FakeNetwork()
        nodes = []
        for i in range(3):
            node = DHTNode(swarm_identity(i + 1), net.endpoint(), TYPES, now_ms=lambda: clock["now"])
            await nursery.start(node.run)
            nodes.append(node)
        target, mallory, office = nodes
        refused = 0
        for i in range(400):
            key, rec = cert_index(swarm_identity(300_000 + i))
            reply = await mallory.request(target.contact(), "store", {"key": key, "record": rec})
            refused += not reply.body["ok"]
        assert refused == 400 - STORE_BURST and target.stats["store_rate_limited"] == refused
        clock["now"] += int(1000 * 32 / STORE_RATE_PER_S)  # a second: room for the office's 32 stores
        model = "ef" * 32
        for v in range(16):  # sixteen volunteers behind one address: a report and a model index each
            key, rec = volunteer_report(swarm_identity(400 + v), model)
            assert (await office.request(target.contact(), "store", {"key": key, "record": rec})).body["ok"]
            key, rec = cert_index(swarm_identity(400 + v), model)
            assert (await office.request(target.contact(), "store", {"key": key, "record": rec})).body["ok"]
        clock["now"] += 10_000  # the bucket refills: the flooder's network may store again
        key, rec = cert_index(swarm_identity(300_999))
        assert (await mallory.request(target.contact(), "store", {"key": key, "record": rec})).body["ok"]
        nursery.cancel_scope.cancel()


def test_topics_for_models_nobody_announces_hold_a_bounded_share_of_gossip():
    """The gossip side of #3: one host's made-up certifier indexes (a topic each)
    filled every gossip topic slot, so a new model's reports were no longer
    gossiped. Short-lived topics now hold at most a quarter of topics and records."""
    state = GossipState(max_topics=40, max_records=100)
    now = wall_ms()
    idents = [Identity.from_seed(i.to_bytes(32, "big")) for i in range(1, 61)]

    def rec(ident, topic, seq=1):
        return Record("t", {"key": topic}, seq, now, now + 60_000, ident.peer_id, b"", b"")

    verdicts = [state.offer(f"certs/{i:064x}/x", rec(ident, f"certs/{i:064x}/x"), now, short=True)
                for i, ident in enumerate(idents)]
    assert verdicts.count("new") == 10 and len(state._short) == 10
    for i, ident in enumerate(idents[:20]):  # honest topics still find room
        assert state.offer(f"model/{i:064x}", rec(ident, f"model/{i:064x}"), now) == "new"
    # a short topic's newer records replace as ever (the same content re-signed: a refresh, kept
    # in its place but not pushed on); it leaves the share when its records expire
    assert state.offer("certs/" + f"{0:064x}/x", rec(idents[0], f"certs/{0:064x}/x", 2), now, short=True) == "refresh"
    state.expire(now + 120_000)
    assert state._short == {} and state._short_count == 0 and state.topics == {}


async def test_evidence_for_a_model_only_made_up_reports_name_lives_minutes_on_a_node(autojump_clock):
    """Over the wire, with the role's policy: a certifier index naming a model
    no live peer announces lives 10 minutes; a made-up report for the model
    (an identity that runs no node) changes nothing; a live volunteer's does."""
    async with trio.open_nursery() as nursery:
        net = FakeNetwork()
        target = DHTNode(swarm_identity(1), net.endpoint(), TYPES, lifetime_cap=lifetime_cap)
        other = DHTNode(swarm_identity(2), net.endpoint(), TYPES)
        for node in (target, other):
            await nursery.start(node.run)
        await other.bootstrap([target.contact()])
        await trio.sleep(1)
        assert target.table.get(other.node_id) is not None  # a live peer to the target
        model = "12" * 32

        async def store(ident: Identity, key: str, rec: bytes) -> int | None:
            assert (await other.request(target.contact(), "store", {"key": key, "record": rec})).body["ok"]
            return target.store.expires_at(key, ident.peer_id.multihash)

        def life(expires: int) -> int:
            return expires - wall_ms()

        assert life(await store(swarm_identity(10), *cert_index(swarm_identity(10), model))) <= UNANNOUNCED_LIFETIME_MS
        await store(swarm_identity(11), *volunteer_report(swarm_identity(11), model))  # made up: no node
        assert life(await store(swarm_identity(12), *cert_index(swarm_identity(12), model))) <= UNANNOUNCED_LIFETIME_MS
        await store(other.identity, *volunteer_report(other.identity, model))  # a live volunteer announces it
        assert life(await store(swarm_identity(13), *cert_index(swarm_identity(13), model))) > 3600_000
        nursery.cancel_scope.cancel()


_KEY_MODEL = "ef" * 32
_T0 = wall_ms()
_SIGNERS = [swarm_identity(700 + i) for i in range(4)]
_VALUES = {(i, seq, ttl): verified(sample_report(_SIGNERS[i], _KEY_MODEL, layers=(0, 10)).sign(
    _SIGNERS[i], seq=seq, now_ms=_T0, ttl_ms=ttl)) for i in range(4) for seq in (1, 2) for ttl in (60_000, 600_000)}


@given(st.lists(st.tuples(st.sampled_from(["put", "read", "read at an expiry"]), st.integers(0, 3), st.integers(1, 2),
                          st.sampled_from([60_000, 600_000]), st.one_of(st.none(), st.integers(1, 700_000)),
                          st.integers(0, 120_000)), max_size=40))
def test_a_read_gives_exactly_the_live_values_whatever_stores_caps_and_renewals_came_before(ops):
    # a read skips walking a key whose values none is due yet (storage.py's lower bound on
    # their expiry): it must never hand out a value past its expiry, nor drop a live one
    key = model_key(_KEY_MODEL)
    store, now, held = ValueStore(), _T0, {}
    for op, i, seq, ttl, cap, dt in ops:
        now += dt
        if op == "read at an expiry":  # the very millisecond a value expires: gone
            now = max(now, min((e for e in held.values() if e >= now), default=now))
        if op == "put":
            rec = _VALUES[(i, seq, ttl)]
            ok, _ = store.put(key, rec, now, source="net", lifetime_cap_ms=cap)
            if ok:
                held[rec.signer.multihash] = rec.expires_at_ms if cap is None else min(rec.expires_at_ms, now + cap)
        else:
            assert set(store.live(key, now)) == {s for s, expires in held.items() if expires > now}
            got, _, _ = store.get(key, now)
            assert {r.signer.multihash for r in got} == {s for s, expires in held.items() if expires > now}


_MODELS = ["a1" * 32, "b2" * 32]
_MANY = [swarm_identity(720 + i) for i in range(8)]
_BY = {(i, m, seq): verified(sample_report(_MANY[i], _MODELS[m], layers=(0, 10)).sign(
    _MANY[i], seq=seq, now_ms=_T0, ttl_ms=60_000 * seq)) for i in range(8) for m in range(2) for seq in (1, 2)}


@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 1), st.integers(1, 2), st.sampled_from("xyz"),
                          st.integers(0, 70_000)), max_size=60))
def test_a_source_is_refused_under_a_key_exactly_when_it_holds_its_share_of_it(ops):
    # the per-(key, source) count the bound reads is kept as values come and go (stored,
    # replaced, expired, evicted for room): it must always equal what the store holds
    store, now = ValueStore(max_values_per_source=2, max_values=6), _T0
    for i, m, seq, source, dt in ops:
        now += dt
        store.expire(now)
        key, rec = model_key(_MODELS[m]), _BY[(i, m, seq)]
        held = {s: meta.source for (k, s), meta in store._meta.items() if k == key}
        ok, reason = store.put(key, rec, now, source=source)
        if rec.expires_at_ms > now and rec.signer.multihash not in held and list(held.values()).count(source) >= 2:
            assert (ok, reason) == (False, "this source already stored 2 values under this key")
        elif reason.startswith("this source already stored"):
            pytest.fail(f"refused with {list(held.values()).count(source)} of 2 held")
        assert store._in_key == Counter((k, meta.source) for (k, _), meta in store._meta.items())
    store.expire(now + 10 * 60_000)
    assert not store._in_key


@given(st.integers(0, 400), st.one_of(st.integers(0, 20_000), st.integers(-60, 60)))
def test_a_one_topic_digest_is_the_longest_prefix_that_fits_its_budget(count, budget):
    """A pull's digest of one topic lists its signers in order, as many as fit
    ``budget`` by its count of bytes (all of them when they fit: then in one pass),
    and packs within it."""
    from meshnet_p2p.dht.gossip import _ENTRY_OVERHEAD, _TOPIC_OVERHEAD, SIGNER_TAG_BYTES

    state = GossipState(max_per_topic=512)
    now = wall_ms()
    topic = "model/" + "ab" * 32
    for i in range(count):
        signer = bytes([0, 36]) + i.to_bytes(36, "big")
        assert state.offer(topic, Record("t", {"key": topic}, i, now, now + 60_000, PeerId(signer), b"", b"w"),
                           now) == "new"
    held = state.topics[topic] if count else {}
    if -60 <= budget <= 60:  # near the edge where the whole topic just fits, or just does not
        budget += 8 + len(topic) + _TOPIC_OVERHEAD + count * (SIGNER_TAG_BYTES + _ENTRY_OVERHEAD)
    got = state.digest_of(topic, budget=budget)[topic]
    used, fits = 8 + len(topic) + _TOPIC_OVERHEAD, 0  # the count, entry by entry
    for signer in held:
        used += SIGNER_TAG_BYTES + _ENTRY_OVERHEAD  # each named by its tag
        if used > budget:
            break
        fits += 1
    assert list(got) == [s[-SIGNER_TAG_BYTES:] for s in list(held)[:fits]]
    assert all(got[s[-SIGNER_TAG_BYTES:]] == held[s].seq for s in list(held)[:fits])
    if got:
        assert len(msgpack.packb({topic: got}, use_bin_type=True)) <= budget


@given(st.lists(st.tuples(st.sampled_from(["offer", "offer", "offer", "expire", "drop"]),
                          st.integers(0, 1), st.integers(0, 11), st.integers(0, 5), st.integers(1, 4)),
                max_size=60))
def test_a_topic_digest_kept_as_records_come_and_go_names_what_is_held(steps):
    """digest_of names a topic's held signers and their seqs in the order held, kept
    as records are offered (new signers, newer and older seqs), expire and are
    dropped, not rebuilt per pull (docs/scale.md)."""
    state, now = GossipState(), wall_ms()
    topics = ["model/" + "ab" * 32, "model/" + "cd" * 32]
    for what, t, who, seq, minutes in steps:
        topic = topics[t]
        if what == "offer":
            signer = bytes([0, 36]) + who.to_bytes(36, "big")
            state.offer(topic, Record("t", {"key": topic}, seq, now, now + minutes * 60_000, PeerId(signer),
                                      b"", b"w"), now)
        elif what == "expire":
            now += 60_000
            state.expire(now)
        else:
            state.drop(topic)
        for topic in topics:
            held = state.topics.get(topic, {})
            assert list(state.digest_of(topic)[topic].items()) == [(r.signer.tag, r.seq) for r in held.values()]
