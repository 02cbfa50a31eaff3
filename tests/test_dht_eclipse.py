"""A certifier's records eclipsed by Sybils ground close to its key (issue 24, item 4).

Real DHTNodes in one process over loopback UDP: honest nodes (the first is
the bootstrap, run by the certifier with its own key), 24 Sybils whose IDs
share 10 bits with the key's, only one of which ever meets an honest node.
A Sybil says "stored" and drops the record, and answers every lookup with its
siblings only, all closer to the key than any honest node.
"""

import json
import os
import threading

import pytest
import trio
import trio.testing

from meshnet_p2p.trust.evidence import index_key, sign_index
from meshnet_p2p.roles.certify import certifier_homes, storage_problem
from meshnet_p2p.dht import node as node_module
from meshnet_p2p.dht.lookup import PER_ANSWER, PER_PATH, diverse, iterative_lookup
from meshnet_p2p.dht.node import DHTConfig, DHTNode, Stored
from meshnet_p2p.dht.routing import Contact, key_id, node_id_of
from meshnet_p2p.core.netgroup import networks
from meshnet_p2p.dht.transport import UdpTransport
from meshnet_p2p.sim.sybil import SybilNode
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.swarm.node import TYPES
from meshnet_p2p.core.records import wall_ms
from meshnet_p2p.swarm.view import newest_signed_by
from meshnet_p2p.testing import swarm_identity

MODEL = "ef" * 32
SYBILS = 24
GROUND_BITS = 10  # the issue measured 0.8 s for 24 such identities
HONEST = 12
QUIET = DHTConfig(gossip_pull_interval=3600.0)  # gossip is not what finds a key: lookups are


# the simulator's colluding node (meshnet_p2p/sim/sybil.py): takes every store and keeps
# nothing, names only its siblings whatever it is asked, passes no gossip on
Sybil = SybilNode


def grind(target: int, count: int, bits: int) -> list[Identity]:
    """Free identities whose node IDs share the top ``bits`` bits with ``target``."""
    found, i = [], 0
    while len(found) < count:
        ident = swarm_identity(50_000 + i)
        i += 1
        if (node_id_of(ident.peer_id) ^ target) >> (256 - bits) == 0:
            found.append(ident)
    return found


async def start(nursery, cls, identity: Identity, config: DHTConfig) -> DHTNode:
    node = cls(identity, await UdpTransport.bind("127.0.0.1", 0), TYPES, config)
    await nursery.start(node.run)
    return node


@pytest.mark.parametrize("defence", ["both", "homes alone"])
async def test_a_certifier_record_survives_sybils_ground_close_to_its_key(defence, monkeypatch):
    """Failed before (certify's put landed on Sybils only; the client found
    nothing). The homes carry it on their own, whatever IDs the carrier and the
    reader draw; disjoint paths alone win only when the group does not meet every
    path (which depends on the IDs: a CI run drew ones where it did), so they are
    shown on the pure lookup below, not claimed here."""
    if defence == "homes alone":
        lookup = node_module.iterative_lookup
        monkeypatch.setattr(node_module, "iterative_lookup", lambda *a, **kw: lookup(*a, **{**kw, "paths": 1}))
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            certifier = swarm_identity(1)  # the bootstrap operator certifies with the bootstrap's key
            key = index_key(MODEL, str(certifier.peer_id))
            target = key_id(key.encode())
            honest = [await start(nursery, DHTNode, swarm_identity(1 + i), QUIET) for i in range(HONEST)]
            boot = honest[0]
            for node in honest[1:]:
                await node.bootstrap([boot.contact()])
            for node in honest[1:]:  # the bootstrap knows everyone (a round trip each)
                assert await boot.ping(node.contact()) is not None
            sybils = [await start(nursery, Sybil, ident, QUIET) for ident in grind(target, SYBILS, GROUND_BITS)]
            for s in sybils:
                s.siblings = [t.contact() for t in sybils]
            assert max(s.node_id ^ target for s in sybils) < min(h.node_id ^ target for h in honest)
            # one Sybil meets one honest node (a round trip: it enters that node's table)
            assert await honest[7].ping(sybils[0].contact()) is not None

            # certify's node: a fresh identity, client mode, through the bootstrap
            carrier = await start(nursery, DHTNode, Identity.generate(), DHTConfig(client_mode=True,
                                                                                  gossip_pull_interval=3600.0))
            await carrier.bootstrap([boot.contact()])
            closest = await carrier.find_node(target)
            assert {c.node_id for c in closest} <= {s.node_id for s in sybils}  # the key is eclipsed
            record = sign_index(certifier, MODEL, ["ab" * 32], now_ms=wall_ms())
            stored = await carrier.publish(key, record, also=await certifier_homes(carrier, certifier.peer_id))
            assert stored.networks == 1  # one host: every node is 127.0.0.1, however many said "stored"
            # the bootstrap, the certifier's own node, keeps it as its own (and republishes it)
            assert [r.signer for r in boot.store.get(key, wall_ms())[0]] == [certifier.peer_id]

            # a fresh client looks the certifier's index up
            reader = await start(nursery, DHTNode, Identity.generate(), DHTConfig(client_mode=True,
                                                                                 gossip_pull_interval=3600.0))
            await reader.bootstrap([boot.contact()])
            found = await newest_signed_by(reader, key, str(certifier.peer_id))
            assert found is not None and found.content["recipes"] == ["ab" * 32]
            nursery.cancel_scope.cancel()


# --- the lookup alone (pure: fake contacts in memory, nothing is sent) ----------------------

TARGET = 1 << 200


def fake(i: int, host: str, node_id: int | None = None) -> Contact:
    c = Contact.of(swarm_identity(i).peer_id, host, 4001)
    return c if node_id is None else Contact(node_id, c.peer_id, host, 4001)


def swarm_with_sybils(honest_host, sybil_host):
    """Honest nodes that all know each other (the nearest to TARGET also knows
    one Sybil), and 24 Sybils closer to TARGET than any honest node that name
    only each other. Returns (honest nearest first, sybils, call, asked)."""
    honest = sorted((fake(i, honest_host(i)) for i in range(1, 41)), key=lambda h: h.node_id ^ TARGET)
    sybils = [fake(100 + i, sybil_host(i), TARGET ^ (i + 1)) for i in range(SYBILS)]
    sybil_ids = {s.node_id for s in sybils}
    asked = []

    async def call(c: Contact):
        asked.append(c)
        await trio.sleep(0.001)
        if c.node_id in sybil_ids:
            return "sybil", [s for s in sybils if s.node_id != c.node_id]
        known = [h for h in honest if h.node_id != c.node_id][:20]
        if c == honest[0]:
            known = [sybils[0], *known[:19]]
        return "honest", known

    return honest, sybils, call, asked


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


def test_one_answer_gives_at_most_two_contacts_of_one_network():
    crowd = [fake(i, f"6.6.6.{i}") for i in range(1, 24)]
    local = [fake(100 + i, "127.0.0.1") for i in range(3)] + [fake(200 + i, "192.168.1.9") for i in range(3)]
    others = [fake(300 + i, f"5.{i}.0.1") for i in range(3)]
    kept = diverse([*crowd, *local, *others], PER_ANSWER)
    assert [c for c in kept if c in crowd] == crowd[:2]
    assert [c for c in kept if c not in crowd] == [*local, *others]  # exempt and distinct networks: all kept
    v6 = [fake(400 + i, f"2a01:4f8:1:{i}::1") for i in range(4)]  # one /48
    assert len(diverse(v6, PER_ANSWER)) == 2


async def test_a_group_on_one_network_cannot_fill_a_lookups_closest(autojump_clock):
    honest, sybils, call, _ = swarm_with_sybils(lambda i: f"5.{i}.0.1", lambda i: f"6.6.6.{i + 1}")
    sybil_ids = {s.node_id for s in sybils}
    seeds = honest[:3]
    # without the bound (as before): the 20 closest are all Sybils, the key is eclipsed
    blind = await iterative_lookup(TARGET, seeds, call, per_answer=None, per_path=None)
    assert {c.node_id for c in blind.closest} <= sybil_ids
    got = await iterative_lookup(TARGET, seeds, call)
    taken = [c for c in got.closest if c.node_id in sybil_ids]
    assert 0 < len(taken) <= PER_PATH
    nearest_honest = honest[: 20 - len(taken)]
    assert [c for c in got.closest if c.node_id not in sybil_ids] == nearest_honest


async def test_disjoint_paths_reach_the_honest_nodes_a_group_hides(autojump_clock):
    # on one host (exempt from the diversity bound): only the paths' disjointness helps
    honest, sybils, call, asked = swarm_with_sybils(lambda i: "127.0.0.1", lambda i: "127.0.0.1")
    sybil_ids = {s.node_id for s in sybils}
    seeds = honest[20:29]  # farther from the target, as a table's are
    one = await iterative_lookup(TARGET, seeds, call)
    assert {c.node_id for c in one.reached} <= sybil_ids  # a put would store on Sybils only
    asked.clear()
    put = await iterative_lookup(TARGET, seeds, call, paths=3)
    assert len(asked) == len({c.node_id for c in asked})  # every node asked by one path at most
    assert sum(1 for p in put.paths if {c.node_id for c in p} <= sybil_ids) <= 1  # the group took one path
    nearest = {h.node_id for h in honest[:20]}
    stored_on = {c.node_id for c in put.reached} & nearest
    assert len(stored_on) >= 10  # the honest paths' closest: most of the honest nodes nearest the key
    get = await iterative_lookup(TARGET, honest[30:39], call, paths=3)  # another reader, other seeds
    answered = {i for i, v in get.responses.items() if v == "honest"}
    assert len(stored_on & answered) >= 10  # a get asks where the put stored


async def test_paths_keep_frozen_peers_from_delaying_the_lookup(autojump_clock):
    honest, _, call, _ = swarm_with_sybils(lambda i: "127.0.0.1", lambda i: "127.0.0.1")
    frozen = {h.node_id for h in honest[2::4]}
    failed, abandoned = [], []

    async def slow_call(c):
        if c.node_id in frozen:
            await trio.sleep_forever()
        return await call(c)

    homes = [honest[38], honest[39]]  # asked directly; one of them frozen
    t0 = trio.current_time()
    got = await iterative_lookup(TARGET, honest[10:19], slow_call, paths=3, also=homes, timeout=0.5,
                                 on_fail=failed.append, on_abandon=abandoned.append)
    assert trio.current_time() - t0 < 0.5  # frozen nodes cost a slow_after each, not a timeout
    assert honest[39].node_id in got.responses and honest[38].node_id not in got.responses
    assert {c.node_id for c in failed + abandoned} <= frozen


# --- how many networks hold a value ----------------------------------------------------------


def test_holders_are_counted_by_network():
    hosts = ["5.1.0.1", "5.1.0.2", "5.2.0.1", "127.0.0.1", "127.0.0.1", "10.0.0.1", "2a01:4f8:1:1::1", "2a01:4f8:1:2::9"]
    assert networks([fake(i, h) for i, h in enumerate(hosts)]) == 5  # two /24s, two exact IPs, one /48


def test_certify_warns_when_few_networks_hold_its_records():
    assert storage_problem(Stored(0, 0), 4) == "no node took the evidence"
    assert "only 1 network of the 5" in storage_problem(Stored(24, 1), 5)  # 24 "stored" from one network
    assert storage_problem(Stored(24, 1), 1) == ""  # a local swarm: all it can see
    assert "only 2 networks" in storage_problem(Stored(9, 2), 8)
    assert storage_problem(Stored(5, 3), 8) == ""


async def test_a_put_reports_the_networks_that_took_it(autojump_clock):
    from meshnet_p2p.swarm.capability import TYPES, model_key
    from meshnet_p2p.testing import sample_report, start_swarm

    async with trio.open_nursery() as nursery:
        network, nodes = await start_swarm(nursery, 12, TYPES, config=DHTConfig(k=4))
        ident = nodes[3].identity
        record = sample_report(ident, MODEL).sign(ident, seq=1, now_ms=wall_ms())
        stored = await nodes[3].put(model_key(MODEL), record)
        holders = [n for n in nodes if n is not nodes[3] and n.store.get(model_key(MODEL), wall_ms())[0]]
        assert stored.nodes == stored == len(holders) >= 4
        assert stored.networks == len({n.addr[0] for n in holders})  # private addresses: one network per IP
        nursery.cancel_scope.cancel()


# --- the attack on a live swarm: real processes, a real certify and generation --------------


def test_sybils_ground_close_to_the_certifiers_key_cannot_darken_a_live_swarm(tmp_path, model_path, model_digest):
    """The issue's measurement, as a user meets it: a bootstrap and three volunteers
    (processes), 24 Sybils ground close to the certifier's index key, one of them in
    the bootstrap's table; `certify` then a generation. Before: certify exited 0 and
    every generation failed `recipe ... is dark`. Now the generation is exact."""
    from meshnet_p2p.engine.tokenizer import Tokenizer
    from meshnet_p2p.core.multiaddr import Multiaddr
    from meshnet_p2p.swarm.node import contact_of

    from tests.reference import reference_generate
    from tests.swarm import certify_swarm, meshnet_peer, start_swarm

    boot, addr, joins = start_swarm(tmp_path, ["0:10", "10:20", "20:30"], certify=False)
    target = key_id(index_key(model_digest, boot.peer_id).encode())
    seed = contact_of(Multiaddr.parse(addr))
    box: dict = {}
    started, stop = threading.Event(), threading.Event()

    class Met(Sybil):  # the one Sybil an honest node meets: it answers the bootstrap's check of it
        met: trio.Event

        def _handle(self, msg, from_addr):
            if msg.kind == "ping" and msg.sender == seed.peer_id:
                self.met.set()
            return super()._handle(msg, from_addr)

    async def sybils() -> None:
        try:
            async with trio.open_nursery() as nursery:
                group = [await start(nursery, Met if i == 0 else Sybil, ident, QUIET)
                         for i, ident in enumerate(grind(target, SYBILS, GROUND_BITS))]
                for s in group:
                    s.siblings = [t.contact() for t in group]
                group[0].met = trio.Event()
                await group[0].request(seed, "find_node", {"target": target.to_bytes(32, "big")})
                with trio.fail_after(30):
                    await group[0].met.wait()  # the bootstrap pinged it back: it enters the bootstrap's table
                probe = await start(nursery, DHTNode, Identity.generate(), DHTConfig(client_mode=True))
                reply = await probe.request(seed, "find_node", {"target": target.to_bytes(32, "big")})
                named = {c.node_id for c in probe._contacts(reply.body.get("nodes"))}
                box["in_table"] = group[0].node_id in named
                box["token"] = trio.lowlevel.current_trio_token()
                started.set()
                await trio.to_thread.run_sync(stop.wait)
                nursery.cancel_scope.cancel()
        except BaseException as e:
            box["error"] = e
            started.set()

    thread = threading.Thread(target=trio.run, args=(sybils,), daemon=True)
    thread.start()
    try:
        assert started.wait(120) and "error" not in box, box.get("error")
        assert box["in_table"]  # the bootstrap names the Sybil: lookups for the key now meet the group
        summary = certify_swarm(addr, boot.identity_path)
        assert summary["stored_on"] >= 1
        prompt = "The capital of France is"
        r = meshnet_peer("generate", "--bootstrap", addr, "--prompt", prompt, "--max-tokens", "8", "--json",
                         env={**os.environ, "MESHNET_CACHE_DIR": str(tmp_path)})
        assert r.returncode == 0, r.stderr[-1000:]
        reference = reference_generate(model_path, Tokenizer(model_path).encode(prompt), 8, n_ubatch=64)[0]
        got = json.loads(r.stdout)["token_ids"]
        assert got == reference[:len(got)] and got
    finally:
        stop.set()
        thread.join(30)
        codes = [j.stop() for j in joins] + [boot.stop()]
    assert codes == [0] * 4
