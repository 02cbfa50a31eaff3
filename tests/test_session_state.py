"""The Session stream's per-session rules (dataplane/session_state.py), as a pure
state machine: examples, then properties over random sequences of events."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from meshnet_p2p.dataplane.session_state import SessionState, Verdict


def opened(credits: int = 4, epoch: int = 1) -> SessionState:
    s = SessionState("s")
    s.open(epoch, credits)
    return s


def test_each_refusal_in_order_of_precedence():
    s = SessionState("s")
    assert s.check_step("w", 1, 0, 0, 0) is Verdict.NOT_OPEN
    assert s.check_rollback(0) is Verdict.NOT_OPEN
    s = opened()
    assert s.check_step("w", 1, 0, 0, 0) is Verdict.EPOCH_STALE
    assert s.check_step("w", 1, 1, 100, 200) is Verdict.DEADLINE
    s.applied(1, 1)
    assert s.check_step("w", 1, 1, 0, 0) is Verdict.DUPLICATE
    s.cancel("w")
    assert s.check_step("w", 2, 1, 0, 0) is Verdict.CANCELLED
    assert s.check_step("other", 2, 1, 0, 0) is Verdict.APPLY
    assert s.check_rollback(0) is Verdict.EPOCH_STALE and s.check_rollback(2) is Verdict.APPLY
    s.rolled_back(2, 5)
    assert s.check_step("other", 2, 1, 0, 0) is Verdict.EPOCH_STALE  # the rollback's newer route rules now
    s.cancel()
    assert s.check_rollback(2) is Verdict.CANCELLED and s.check_step("other", 2, 2, 0, 0) is Verdict.CANCELLED


def test_credit_runs_out_and_tops_up_to_the_grant_only():
    s = opened(credits=2)
    for n in (1, 2):
        assert s.check_step("w", n, 1, 0, 0) is Verdict.APPLY
        s.applied(n, 1)
    assert s.check_step("w", 3, 1, 0, 0) is Verdict.NO_CREDIT
    assert s.top_up(100) == 2  # never beyond what was granted


_events = st.lists(st.one_of(
    st.tuples(st.just("step"), st.integers(0, 12), st.integers(0, 3), st.sampled_from(["a", "b"])),
    st.tuples(st.just("top_up"), st.integers(0, 5)),
    st.tuples(st.just("cancel"), st.sampled_from(["", "a", "b"])),
    st.tuples(st.just("rollback"), st.integers(0, 3), st.integers(0, 12)),
), max_size=40)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4), _events)
def test_no_step_is_applied_twice_and_credit_never_goes_negative(credits, events):
    s = opened(credits=credits)
    applied_steps = []
    segments = [applied_steps]  # steps applied since the last rollback to a newer route
    for ev in events:
        if ev[0] == "step":
            _, n, epoch, work = ev
            verdict = s.check_step(work, n, epoch, 0, 0)
            if verdict is Verdict.APPLY:
                assert n not in segments[-1] and epoch >= s.epoch and not s.cancelled
                segments[-1].append(n)
                s.applied(n, epoch)
        elif ev[0] == "top_up":
            s.top_up(ev[1])
        elif ev[0] == "cancel":
            s.cancel(ev[1])
        elif ev[0] == "rollback" and s.check_rollback(ev[1]) is Verdict.APPLY:
            newer = ev[1] > s.epoch
            s.rolled_back(ev[1], ev[2])
            if newer:  # a newer route's steps past the rollback point are new (a ring's failover)
                segments.append([n for n in segments[-1] if n <= ev[2]])
        assert 0 <= s.credits <= s.max_credits
    for seg in segments:  # within a route, steps apply in increasing order: a replayed one is a duplicate
        assert seg == sorted(seg)
