"""Issue 24 #0, the roles' side: one failure in one background loop never ends
a peer. Each loop's iteration is made to throw (the call inside it
monkeypatched); the loop must count the error, go on, and back off rather
than spin. (The DHT node's own loops: tests/test_dht_flood.py.)"""

from collections import Counter
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from meshnet_p2p.core import guard as guard_module


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


class Boom(RuntimeError):
    pass


async def aboom(*args, **kwargs):
    raise Boom("injected")


async def run_for(seconds: float, fn, *args) -> None:
    """Run ``fn`` for ``seconds`` of (virtual) time; it must not end by itself."""
    with trio.move_on_after(seconds) as scope:
        await fn(*args)
    assert scope.cancelled_caught, f"{fn.__name__} ended"


async def test_the_announcer_counts_a_failing_announce_and_announces_again(autojump_clock):
    from meshnet_p2p.swarm.announcer import Announcer

    counts, calls = Counter(), []

    def records():
        calls.append(trio.current_time())
        if len(calls) <= 3:
            raise Boom("a bug in one announce")
        return [("model/x", b"report")]

    async def publish(key, record):
        return 1

    await run_for(200, Announcer(publish, records, interval=30.0, counts=counts).run)
    assert counts["loop_errors_announce"] == 3 and len(calls) >= 5


async def test_the_announcer_says_when_the_swarm_stops_and_starts_again_taking_its_report(autojump_clock):
    from meshnet_p2p.core.errors import MeshnetError
    from meshnet_p2p.swarm.announcer import Announcer

    said, answers = [], iter([1, 0, 0, MeshnetError("no node answered"), 2])

    async def publish(key, record):
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    a = Announcer(publish, lambda: [("model/x", b"report")], interval=30.0, log=said.append)
    assert [await a.announce() for _ in range(5)] == [1, 0, 0, None, 2]
    assert said == ["announce reached no peer; retrying every 30 s",
                    "announce failed, retrying in 30 s: no node answered", "announce reaching peers again (2)"]


async def test_no_report_follows_the_departing_one(autojump_clock):
    from meshnet_p2p.swarm.announcer import Announcer

    sent = []

    async def publish(key, record):
        sent.append(record)
        return 1

    a = Announcer(publish, lambda: [("model/x", b"report")], interval=30.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(a.run)
        await trio.sleep(65)  # three rounds: at once, 30 s, 60 s
        await a.depart("model/x", b"departing")
        a.wake()
        await trio.sleep(300)
    assert sent == [b"report"] * 3 + [b"departing"]


async def test_the_reachability_recheck_counts_a_failing_check_and_asks_again(autojump_clock, monkeypatch):
    from meshnet_p2p.roles.volunteer import RECHECK_S, Reachable

    node = SimpleNamespace(stats=Counter())
    reach = Reachable(node, SimpleNamespace(relay=None), None, "/ip4/127.0.0.1/tcp/1", print, lambda: None)
    monkeypatch.setattr(reach, "check", aboom)
    await run_for(RECHECK_S * 8, reach.recheck, "/ip4/127.0.0.1/tcp/1")
    assert node.stats["loop_errors_recheck"] >= 3


async def test_the_relay_keeper_counts_a_failing_search_and_searches_again(autojump_clock):
    from meshnet_p2p.core.identity import Identity
    from meshnet_p2p.nat.keeper import RelayKeeper

    node = SimpleNamespace(stats=Counter())
    keeper = RelayKeeper(node, Identity.generate(), ("127.0.0.1", 1), on_change=lambda held: None,
                         print_line=lambda line: None)
    keeper.offers = aboom
    await run_for(120, keeper.run)
    errors = node.stats["loop_errors_relay_keeper"]
    assert 3 <= errors <= 15  # backed off: not one a tick


async def test_the_monitor_counts_a_survey_that_breaks_and_surveys_again(autojump_clock):
    from meshnet_p2p.trust.policy import TrustPolicy
    from meshnet_p2p.roles.monitor import Monitor

    monitor = Monitor(aboom, TrustPolicy(), interval_s=3.0, clock=lambda: 0)
    await run_for(60, monitor.run)
    assert monitor.errors["loop_errors_survey"] >= 3


async def test_the_idle_session_reaper_counts_a_failure_and_reaps_again(autojump_clock, monkeypatch):
    from meshnet_p2p.roles import serve
    from meshnet_p2p.roles.serve import _reap_idle_sessions

    async def in_place(fn, *args):  # (a thread's real time would let the virtual clock jump past the test)
        return fn(*args)

    monkeypatch.setattr(serve.trio.to_thread, "run_sync", in_place)

    calls = []

    def reap_idle():
        calls.append(1)
        raise Boom("a bug in one reap")

    servicer = SimpleNamespace(limits=SimpleNamespace(session_idle_ms=1000), reap_idle=reap_idle)
    before = guard_module.LOOP_ERRORS.snapshot().get("loop_errors_reap_idle", 0)
    await run_for(30, _reap_idle_sessions, servicer)
    assert guard_module.LOOP_ERRORS.snapshot()["loop_errors_reap_idle"] - before == len(calls) >= 3
