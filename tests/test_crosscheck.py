"""Cross-checked generation (verify/crosscheck.py) over unit-test doubles of routes:
what is handed on, what is settled by a third route, who is caught, and when the
answer is withheld. The live attack is in tests/test_verified_compute.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshnet_p2p.verify.crosscheck import CrossCheckedRoute, OutputWithheld, peers_of
from meshnet_p2p.route.errors import GenerationError
from meshnet_p2p.route.generation import generate
from meshnet_p2p.verify.peer_records import PeerRecords

HONEST = [11, 12, 13, 14, 15, 16]


@dataclass
class FakeRoute:
    """A route of ``peers`` answering the honest tokens, or ``lie(position)`` where it returns one."""

    peers: list[str]
    lie: object = None
    nets: dict = field(default_factory=dict)  # peer -> its network (default: a network of its own)
    fail_at: int | None = None
    n_ubatch: int = 4
    failovers: int = 0
    closed: bool = False
    seen: list = field(default_factory=list)
    retired: list = field(default_factory=list)

    @property
    def hops(self):
        return [SimpleNamespace(span=SimpleNamespace(peer_id=p, network=self.nets.get(p, f"net-{p}")))
                for p in self.peers]

    def step(self, position, token_ids, decode):
        self.seen.append((position, tuple(token_ids), decode))
        if self.fail_at is not None and position >= self.fail_at:
            raise GenerationError("gave up after 4 failovers")
        token = HONEST[min(len(self.seen) - 1, len(HONEST) - 1)]
        if self.lie is not None and self.lie(position) is not None:
            token = self.lie(position)
        return SimpleNamespace(token_id=token, is_eog=False)

    def route(self):
        return [{"peer_id": p, "layers": [0, 1]} for p in self.peers]

    def close(self):
        self.closed = True


def opener(*routes, verified=()):
    """open_disjoint over a queue of prepared routes, checking each is disjoint from what it must
    avoid (peers and networks); ``verified``: the peers a third route may be made of."""
    queue = list(routes)
    asked = []

    def open_disjoint(exclude, networks=frozenset(), verified_only=False):
        asked.append(set(exclude))
        open_disjoint.networks.append(set(networks))
        for r in queue:
            nets = {h.span.network for h in r.hops}
            if not set(r.peers) & exclude and not nets & networks and \
                    (not verified_only or set(r.peers) <= set(verified)):
                queue.remove(r)
                return r
        raise GenerationError("no route")
    open_disjoint.networks = []
    open_disjoint.asked = asked
    return open_disjoint


def run(route, n=5):
    return generate(route, [1, 2, 3], n, stop_at_eog=False).token_ids


def test_two_honest_routes_hand_on_every_token():
    a, b = FakeRoute(["a"]), FakeRoute(["b1", "b2"])
    route = CrossCheckedRoute([a, b], opener(), PeerRecords())
    assert run(route) == HONEST[:5]
    assert a.seen == b.seen  # the same steps, in the same micro-batch structure
    assert route.disputes == []


def test_a_lying_one_hop_route_is_outvoted_caught_and_dropped():
    records = PeerRecords()
    liar = FakeRoute(["evil"], lie=lambda pos: 666)
    honest, third = FakeRoute(["h1", "h2"]), FakeRoute(["h3", "h4"])
    events = []
    route = CrossCheckedRoute([liar, honest], opener(third, verified=["h3", "h4"]), records, on_event=events.append)
    assert run(route) == HONEST[:5]  # the liar's token is never handed on
    assert "evil" in records.caught() and not records.verified("evil")
    assert liar.closed and route.routes == [honest, third]
    [dispute] = route.disputes
    assert dispute["caught"] == ["evil"] and dispute["position"] == 0
    assert third.seen == honest.seen  # brought level by replaying the same steps
    assert any("caught" in e for e in events)


def test_the_third_route_avoids_every_peer_of_both():
    liar, honest, third = FakeRoute(["evil"], lie=lambda p: 666), FakeRoute(["h1"]), FakeRoute(["h3"])
    open_disjoint = opener(third, verified=["h3"])
    run(CrossCheckedRoute([liar, honest], open_disjoint, PeerRecords()))
    assert {"evil", "h1"} <= open_disjoint.asked[0]
    assert {"net-evil", "net-h1"} <= open_disjoint.networks[0]  # and every network of both


def test_a_sybil_pair_cannot_cross_check_each_other_nor_settle_a_dispute():
    """Issue 59, the Sybil pair: two identities on one network, both lying the same way, were
    the two "disjoint" routes of --verify always (the attacker's text, marked cross-checked),
    and one of them could be the third route that settles a dispute. Disjoint now means no
    network in common, and a third route is made of verified peers only."""
    records = PeerRecords()
    sybil1 = FakeRoute(["s1"], lie=lambda p: 666, nets={"s1": "10.0.0.0/24"})
    sybil2 = FakeRoute(["s2"], lie=lambda p: 666, nets={"s2": "10.0.0.0/24"})
    honest = FakeRoute(["h1", "h2"])
    # always: the second route of a Sybil-first pair is never its twin
    open_disjoint = opener(sybil2, honest, verified=["h1", "h2"])
    route = CrossCheckedRoute([sybil1], open_disjoint, records)
    route.routes.append(open_disjoint(peers_of(sybil1), {"10.0.0.0/24"}))
    assert route.routes[1] is honest
    # a dispute between a Sybil and an honest route: the unverified twin may not settle it
    records2 = PeerRecords()
    twin = FakeRoute(["s3"], lie=lambda p: 666, nets={"s3": "10.0.0.0/24"})
    other_sybil = FakeRoute(["s4"], lie=lambda p: 666, nets={"s4": "10.9.9.0/24"})  # another network, no record
    route2 = CrossCheckedRoute([FakeRoute(["s1"], lie=lambda p: 666, nets={"s1": "10.0.0.0/24"}), FakeRoute(["h9"])],
                               opener(twin, other_sybil), records2)
    with pytest.raises(OutputWithheld, match="verified peers on other networks"):
        run(route2)
    assert records2.caught() == {}  # withheld, nobody convicted by Sybils


def test_without_a_third_route_the_answer_is_withheld_and_nobody_is_blamed():
    records = PeerRecords()
    route = CrossCheckedRoute([FakeRoute(["evil"], lie=lambda p: 666), FakeRoute(["h1"])], opener(), records)
    with pytest.raises(OutputWithheld, match="withheld"):
        run(route)
    assert records.caught() == {}


def test_a_withheld_answer_sends_both_routes_to_the_audits_that_can_still_prove_who_lied():
    """Issue 59: a vouched whole-model liar against a chain, with no verified third route,
    withholds the answer; its audit (replays on other networks) then makes the proof that
    stops the next client, instead of every fresh client being withheld in turn."""
    evil, honest, proved = FakeRoute(["evil"], lie=lambda p: 666), FakeRoute(["h1", "h2"]), []
    route = CrossCheckedRoute([evil, honest], opener(), PeerRecords(), prove=proved.append)
    with pytest.raises(OutputWithheld):
        run(route)
    assert proved == [evil, honest]
    z = FakeRoute(["z"], lie=lambda p: 777)
    route = CrossCheckedRoute([FakeRoute(["x"], lie=lambda p: 666), FakeRoute(["y"])], opener(z, verified=["z"]),
                              PeerRecords(), prove=proved.append)
    with pytest.raises(OutputWithheld, match="nothing decides"):
        run(route)
    assert [r.peers for r in proved[2:]] == [["x"], ["y"]]


def test_a_third_route_that_agrees_with_neither_withholds_the_answer():
    route = CrossCheckedRoute([FakeRoute(["x"], lie=lambda p: 666), FakeRoute(["y"])],
                              opener(FakeRoute(["z"], lie=lambda p: 777), verified=["z"]), PeerRecords())
    with pytest.raises(OutputWithheld, match="nothing decides"):
        run(route)


def test_a_liar_on_a_route_of_several_hops_is_left_to_localize_and_otherwise_nobody_is_caught():
    records = PeerRecords()
    bad = FakeRoute(["m1", "m2"], lie=lambda p: 666 if p >= 4 else None)
    route = CrossCheckedRoute([bad, FakeRoute(["h1"])], opener(FakeRoute(["h2"]), verified=["h2"]), records,
                              localize=lambda r: [])
    assert run(route) == HONEST[:5]
    assert records.caught() == {}  # two hops: no proof against either without an audit
    assert not records.verified("m1") and not records.verified("m2")
    route2 = CrossCheckedRoute([FakeRoute(["m3", "m4"], lie=lambda p: 666), FakeRoute(["h5"])],
                               opener(FakeRoute(["h6"]), verified=["h6"]), records, localize=lambda r: ["m4"])
    run(route2)
    assert route2.disputes[0]["caught"] == ["m4"]


def test_a_route_that_gives_up_is_replaced_by_a_disjoint_one_brought_level():
    dying, honest, spare = FakeRoute(["d"], fail_at=5), FakeRoute(["h1"]), FakeRoute(["s"])
    route = CrossCheckedRoute([dying, honest], opener(spare), PeerRecords())
    assert run(route) == HONEST[:5]
    assert route.routes[0] is spare and spare.seen == honest.seen
    with pytest.raises(OutputWithheld, match="no other route"):
        run(CrossCheckedRoute([FakeRoute(["d2"], fail_at=4), FakeRoute(["h2"])], opener(), PeerRecords()))


def test_peers_of_a_route_include_those_failed_over():
    r = FakeRoute(["a", "b"])
    r.retired.append(SimpleNamespace(span=SimpleNamespace(peer_id="old")))
    assert peers_of(r) == {"a", "b", "old"}


def test_records_audit_every_session_until_verified_then_less_and_again_after_a_mismatch():
    rec = PeerRecords()
    assert rec.audit_probability("p", 0.05) == 1.0 and not rec.verified("p")
    rec.matched("p")
    assert rec.verified("p") and rec.audit_probability("p", 0.05) == 0.5
    for _ in range(98):
        rec.matched("p")
    assert rec.audit_probability("p", 0.05) == 0.05
    rec.unconfirmed("p")
    assert not rec.verified("p") and rec.audit_probability("p", 0.05) == 1.0
    rec.vouch(["v"])
    # a certificate's vouch: planned without a second route, audited until this client verified it
    assert rec.verified("v") and rec.audit_probability("v", 0.05) == 1.0
    rec.catch("v", "lied")
    assert not rec.verified("v") and rec.caught() == {"v": "lied"}


def test_records_are_kept_in_a_file_of_their_own_and_a_bad_file_starts_afresh(tmp_path):
    import os
    import stat

    import msgpack

    from meshnet_p2p.verify.peer_records import MAX_KEPT, PeerRecord, load_records

    path = str(tmp_path / "records" / "m.msgpack")
    rec = PeerRecords(path)
    rec.matched("good")
    rec.matched("good")
    rec.unconfirmed("odd")
    rec.catch("evil", "lied at position 5")
    again = PeerRecords(path)  # the next run of the client
    assert again.verified("good") and again.caught() == {"evil": "lied at position 5"}
    assert again.snapshot()["odd"]["unconfirmed_mismatches"] == 1 and not again.verified("odd")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    for junk in (b"", b"\xc1", b"\x93\x01\x02\x03", bytes(100), msgpack.packb({5: [1, 0, ""]})):
        with open(path, "wb") as f:
            f.write(junk)
        assert load_records(path) == {}
    with open(path, "wb") as f:
        f.write(msgpack.packb({"p": [1, 0, ""], "q": ["x", 0, ""], "r": [-1, 0, ""], "s": [1, 0]}))
    assert set(load_records(path)) == {"p"}  # each malformed entry left out
    many = PeerRecords(str(tmp_path / "many.msgpack"))
    for i in range(MAX_KEPT + 10):
        many._by[f"p{i}"] = PeerRecord(verified=i)
    many.catch("evil", "lied")
    kept = load_records(str(tmp_path / "many.msgpack"))
    assert len(kept) == MAX_KEPT and "evil" in kept and "p0" not in kept  # the caught and best verified stay
    assert PeerRecords(None).path is None  # in this process only


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(st.binary(max_size=300), st.builds(lambda x: __import__("msgpack").packb(x), st.recursive(
    st.one_of(st.none(), st.integers(-5, 2**64 - 1), st.text(max_size=8), st.binary(max_size=8)),
    lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=8), kids, max_size=4)),
    max_leaves=10))))
def test_any_records_file_loads_or_starts_afresh(tmp_path_factory, data):
    from meshnet_p2p.verify.peer_records import load_records

    path = tmp_path_factory.mktemp("rec") / "r.msgpack"
    path.write_bytes(data)
    out = load_records(str(path))
    assert isinstance(out, dict) and all(isinstance(k, str) for k in out)


def test_one_route_of_verified_peers_is_stepped_alone():
    records = PeerRecords()
    records.vouch(["a", "b"])
    only = FakeRoute(["a", "b"])
    open_disjoint = opener(FakeRoute(["c"]))
    route = CrossCheckedRoute([only], open_disjoint, records)
    assert run(route) == HONEST[:5]
    assert open_disjoint.asked == [] and route.summary()["mode"] == "verified-peers"


def test_a_route_through_a_peer_without_a_record_enlists_a_second_before_its_first_step():
    records = PeerRecords()
    records.vouch(["a"])
    primary, shadow = FakeRoute(["a", "new"]), FakeRoute(["c"])
    route = CrossCheckedRoute([primary], opener(shadow), records)
    assert run(route) == HONEST[:5]
    assert shadow.seen == primary.seen and route.summary()["mode"] == "cross-checked"


def test_a_failover_onto_a_peer_without_a_record_enlists_a_second_route_brought_level():
    records = PeerRecords()
    records.vouch(["a", "b"])

    class FailsOver(FakeRoute):
        def step(self, position, token_ids, decode):
            if position == 4:  # a failover inside this step: "b" replaced by a peer with no record, who lies
                self.peers = ["a", "liar"]
                self.lie = lambda pos: 666 if pos >= 4 else None
            return super().step(position, token_ids, decode)

    primary, shadow, third = FailsOver(["a", "b"]), FakeRoute(["c"]), FakeRoute(["d"])
    route = CrossCheckedRoute([primary], opener(shadow, third, verified=["d"]), records)
    assert run(route) == HONEST[:5]  # the liar's token is never handed on
    assert shadow.seen[:len(primary.seen)] == primary.seen  # brought level, then the step that failed over
    assert third.seen == shadow.seen
    [dispute] = route.disputes
    assert dispute["position"] == 4 and route.routes == [shadow, third]


def test_with_no_second_route_a_route_without_records_runs_unchecked_and_says_so():
    events = []
    route = CrossCheckedRoute([FakeRoute(["new"])], opener(), PeerRecords(), on_event=events.append)
    assert run(route) == HONEST[:5]
    assert route.summary()["mode"] == "unchecked" and route.summary()["unverified_peers"] == ["new"]
    assert sum("not cross-checked" in e for e in events) == 1  # said once, not at every step


def test_one_vouched_peer_computing_every_layer_is_checked_by_a_second_route():
    """Issue 59, the sleeper: a vouch is someone else's check. A route of one hop, whose peer
    alone computes the whole answer, runs beside a second route until this client's own
    checks matched that peer: a vouched peer turned liar is outvoted before its first token."""
    records = PeerRecords()
    records.vouch(["whole", "h1", "h2", "h3"])
    sleeper = FakeRoute(["whole"], lie=lambda pos: 666)
    chain, third = FakeRoute(["h1", "h2"]), FakeRoute(["h3"])
    route = CrossCheckedRoute([sleeper], opener(chain, third, verified=["h3"]), records)
    assert run(route) == HONEST[:5]  # the liar's text is never handed on
    assert "whole" in records.caught() and route.summary()["mode"] == "cross-checked"


def test_a_whole_model_peer_this_client_checked_itself_is_stepped_alone():
    records = PeerRecords()
    records.vouch(["whole"])
    records.matched("whole")  # this client's own exact check, not only a vouch
    open_disjoint = opener(FakeRoute(["c"]))
    route = CrossCheckedRoute([FakeRoute(["whole"])], open_disjoint, records)
    assert run(route) == HONEST[:5]
    assert open_disjoint.asked == [] and route.summary()["mode"] == "verified-peers"


def test_agreeing_step_for_step_with_verified_peers_checks_a_whole_model_session():
    records = PeerRecords()
    records.vouch(["whole", "h1", "h2"])
    whole, chain = FakeRoute(["whole"]), FakeRoute(["h1", "h2"])
    route = CrossCheckedRoute([whole], opener(chain), records)
    run(route)
    assert route.checked_alone() == {"whole"}  # the client's own check: the audit is not run again
    # a route of a peer with no record checks nothing (it may be the liar's own); the
    # vouched one checks it, as an audit's replay would
    records2 = PeerRecords()
    records2.vouch(["whole"])
    route = CrossCheckedRoute([FakeRoute(["whole"])], opener(FakeRoute(["new"])), records2)
    run(route)
    assert route.summary()["mode"] == "cross-checked" and route.checked_alone() == {"new"}
    # a second route brought level after the first step was compared from then on only
    records3 = PeerRecords()
    records3.vouch(["whole", "h1"])
    late = CrossCheckedRoute([FakeRoute(["whole"])], opener(FakeRoute(["h1"])), records3)
    late.unchecked = "not yet"  # the first step alone
    late.step(0, (1, 2, 3), False)
    late.unchecked = ""
    late.step(3, (11,), True)
    assert len(late.routes) == 2 and late.checked_alone() == set()


def test_a_whole_model_peer_with_no_second_route_runs_unchecked_and_says_why():
    records, events = PeerRecords(), []
    records.vouch(["whole"])
    route = CrossCheckedRoute([FakeRoute(["whole"])], opener(), records, on_event=events.append)
    assert run(route) == HONEST[:5]
    assert route.summary()["mode"] == "unchecked" and route.checked_alone() == set()
    assert sum("computes every layer alone" in e for e in events) == 1
