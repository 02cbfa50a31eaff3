"""Fair shares of a peer's sessions (dataplane/admission.py), as a pure function:
examples, then properties over random crowds of claimants."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from meshnet_p2p.dataplane.admission import Admit, Claimant, Held, Reclaim, Refuse, anonymous_budget, decide
from meshnet_p2p.core.netgroup import host_group


def held(*claims: tuple[str, str | None], idle: int = 0) -> list[Held]:
    return [Held(f"s{i}", Claimant(h, c), idle + i, False) for i, (h, c) in enumerate(claims)]


A1, A2, B1 = Claimant("a", "1"), Claimant("a", "2"), Claimant("b", "1")


def test_a_lone_client_may_use_every_session():
    assert decide(held(("a", "1"), ("a", "1"), ("a", "1")), A1, capacity=4) == Admit()
    assert isinstance(decide(held(*[("a", "1")] * 4), A1, capacity=4), Refuse)


def test_a_newcomer_takes_back_the_longest_idle_session_of_the_biggest_group():
    h = held(("a", "1"), ("a", "1"), ("a", "1"), ("b", "1"))
    h[0] = Held("busy", A1, 10_000, True)  # idle longest, but computing: spared while others are not
    assert decide(h, Claimant("c", "9"), capacity=4) == Reclaim("s2")


def test_addresses_come_before_identities():
    crowd = held(("a", "1"), ("a", "2"), ("a", "3"), ("b", "1"))
    assert isinstance(decide(crowd, Claimant("a", "4"), capacity=4), Refuse)  # a fresh identity wins nothing
    assert isinstance(decide(crowd, Claimant("b", "2"), capacity=4), Reclaim)  # the other address: 3 vs 1
    same_host = held(("a", "1"), ("a", "1"), ("a", "1"), ("b", "1"))
    assert decide(same_host, A2, capacity=4) == Reclaim("s2")  # within an address, its clients share it


def test_anonymous_clients_share_one_budget():
    assert decide([], Claimant("a", None), capacity=4) == Admit()
    one = held(("b", None))
    refusal = decide(one, Claimant("a", None), capacity=4)
    assert isinstance(refusal, Refuse) and "anonymous budget of 1 session;" in refusal.reason
    assert decide(one, A1, capacity=4) == Admit()
    assert decide(held(("b", None)), Claimant("a", None), capacity=8) == Admit()  # 8 // 4 = 2


def test_address_groups():
    assert host_group("203.0.113.7") == "203.0.113.7"
    assert host_group("::ffff:203.0.113.7") == "203.0.113.7"
    assert host_group("2001:db8:1:2:3:4:5:6") == host_group("2001:db8:1:2:ffff::1") == "2001:db8:1:2::/64"
    assert host_group("fe80::1%eth0") == "fe80::/64"
    assert host_group("not an address") == "not an address"


claimants = st.builds(Claimant, st.sampled_from("abc"), st.sampled_from(["1", "2", "3", None]))


@given(st.lists(claimants, max_size=12), claimants, st.integers(1, 8))
def test_never_past_capacity_and_only_from_a_bigger_group(crowd, who, capacity):
    h = [Held(f"s{i}", c, i, False) for i, c in enumerate(crowd[:capacity])]
    d = decide(h, who, capacity=capacity)
    if len(h) >= capacity:
        assert not isinstance(d, Admit)
    if isinstance(d, Reclaim):
        victim = next(x.claimant for x in h if x.session_id == d.session_id)
        hosts = Counter(x.claimant.host for x in h)
        if victim.host != who.host:
            assert hosts[victim.host] >= hosts[who.host] + 2
        else:
            slots = Counter(x.claimant.slot for x in h if x.claimant.host == who.host)
            assert slots[victim.slot] >= slots[who.slot] + 2


@given(st.lists(claimants, min_size=1, max_size=40), st.integers(1, 8))
def test_shares_settle_max_min_fair_and_never_flip_back(requests, capacity):
    """Claimants ask in some order, then keep asking in turn until all are
    refused: that ends, the peer is full, and shares differ by at most one
    between the addresses that asked (when none is anonymous)."""
    h: list[Held] = []
    n = 0

    def ask(who) -> bool:
        nonlocal h, n
        d = decide(h, who, capacity=capacity)
        if isinstance(d, Reclaim):
            victim = next(x for x in h if x.session_id == d.session_id)
            assert victim.claimant != who
            h = [x for x in h if x.session_id != d.session_id]
        if not isinstance(d, Refuse):
            n += 1
            h.append(Held(f"n{n}", who, -n, False))  # the newest is the least idle
        assert len(h) <= capacity
        return not isinstance(d, Refuse)

    for who in requests:
        ask(who)
    distinct = list(dict.fromkeys(requests))
    for _ in range(4 * capacity * len(distinct)):  # bounded: each reclaim strictly evens the counts
        if not any([ask(who) for who in distinct]):
            break
    else:
        raise AssertionError("shares never settled")
    named = {c.host for c in requests if c.client is not None}
    counts = Counter(x.claimant.host for x in h)
    assert len(h) == (capacity if named else min(capacity, anonymous_budget(capacity)))
    if all(c.client is not None for c in requests):
        assert max(counts[x] for x in named) - min(counts[x] for x in named) <= 1
