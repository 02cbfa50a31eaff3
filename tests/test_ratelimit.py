"""The one token bucket (core/ratelimit.py): its contract, and properties that every
user of it (HTTP/2 frame budgets, calls per source, ring links, relay bandwidth,
DHT stores, gossip) rests on."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshnet_p2p.core.ratelimit import SourceRates, TokenBucket


def test_a_burst_at_once_then_the_rate():
    b = TokenBucket(burst=3, rate=2.0, now=10.0)
    assert [b.spend(10.0) for _ in range(4)] == [True, True, True, False]
    assert not b.spend(10.4)  # 0.8 of a token
    assert b.spend(10.5) and not b.spend(10.5)  # one a half second
    assert b.level(100.0) == 3  # never more than a burst


def test_a_clock_in_milliseconds_and_one_that_steps_back():
    b = TokenBucket(burst=1, rate=20.0, now=1_000, ticks_per_s=1000)
    assert b.spend(1_000) and not b.spend(1_049) and b.spend(1_050)  # 20 a second: one per 50 ms
    assert not b.spend(900)  # back in time: nothing refills
    assert b.level(950) == 1  # ...and from there time runs on


def test_take_waits_for_at_most_a_burst_and_says_how_long():
    b = TokenBucket(burst=500.0, rate=1000.0, now=0.0)
    assert b.take(0.0, 250) == 0.0 and b.take(0.0, 250) == 0.0
    assert b.take(0.0, 250) == pytest.approx(0.25)  # not taken: ask again then
    assert b.take(0.25, 250) == 0.0
    assert b.take(0.25, 2000) == pytest.approx(0.5)  # a chunk over a burst waits for a burst...
    assert b.take(0.75, 2000) == 0.0 and b.level(0.75) == -1500  # ...and goes into debt for the rest


def test_charge_goes_into_debt_of_at_most_a_burst():
    b = TokenBucket(burst=4, rate=2.0, now=0.0)
    for _ in range(20):
        b.charge(0.0)
    assert b.level(0.0) == -4 and b.debt_s(0.0) == 2.0
    assert b.debt_s(2.0) == 0.0 and not b.spend(2.0) and b.spend(2.5)


@given(st.floats(0.5, 100), st.floats(0.1, 1000), st.lists(st.floats(0, 10), max_size=60))
def test_never_more_than_burst_plus_rate_times_elapsed(burst, rate, steps):
    """Over any run of calls, what spend lets through is at most one burst plus the
    rate over the time elapsed, and the level stays within [0, burst]."""
    b = TokenBucket(burst, rate, 0.0)
    now, taken = 0.0, 0
    for dt in steps:
        now += dt
        taken += b.spend(now)
        assert 0 <= b.level(now) <= burst
    assert taken <= burst + rate * now + 1e-9


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 200)), max_size=80))
def test_source_rates_is_one_bucket_per_source(calls):
    """SourceRates answers each source as that source's own bucket would, and keeps at
    most max_sources of them (a forgotten source starts full, as a new one does)."""
    rates = SourceRates(rate_per_s=10.0, burst=2.0, max_sources=3)
    mine: dict[int, TokenBucket] = {}
    now = 0
    for source, dt in calls:
        now += dt
        if source not in rates._buckets:
            mine.pop(source, None)
        bucket = mine.setdefault(source, TokenBucket(2.0, 10.0, now, ticks_per_s=1000))
        assert rates.allow(source, now) == bucket.spend(now)
        assert len(rates) <= 3
