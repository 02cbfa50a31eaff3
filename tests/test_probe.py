"""The probe before a route's first plan (route/probe.py): one TCP connect to each
candidate on real loopback sockets, and when to stop waiting for the rest."""

from __future__ import annotations

import os
import socket
import time

from hypothesis import assume, given, strategies as st

from meshnet_p2p.route.probe import (MAX_PROBES, PROBE_MAX_S, PROBE_MIN_S, probe_candidates,
                                      probe_round_trips, probe_wait_s)
from meshnet_p2p.swarm.placement import Span


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_probe_measures_who_accepts_and_waits_no_longer_for_the_rest():
    """Listeners answer; a listener whose backlog is full drops the SYN (as an address
    that hangs does); a port nobody listens on refuses. The probe returns the round trips
    of the first two, closes everything, and stops waiting by its bound."""
    near = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(0)
    filler = [socket.socket() for _ in range(4)]  # fill the backlog: later SYNs are dropped
    for f in filler:
        f.setblocking(False)
        f.connect_ex(hung.getsockname())
    shut = socket.create_server(("127.0.0.1", 0))
    refused_port = shut.getsockname()[1]
    shut.close()
    targets = {"a": near[0].getsockname(), "b": near[1].getsockname(), "hung": hung.getsockname(),
               "refused": ("127.0.0.1", refused_port)}
    before = _open_fds()
    t0 = time.monotonic()
    got = probe_round_trips(targets)
    took = time.monotonic() - t0
    try:
        assert set(got) == {"a", "b"}, got
        assert all(0 <= ms < 1000 for ms in got.values())
        # "hung" never answers: the wait ends by its bound
        assert took < PROBE_MAX_S + 0.5
        assert _open_fds() == before  # every probe's socket is closed
    finally:
        for s in [*near, hung, *filler]:
            s.close()


def test_a_probe_of_targets_that_all_answer_ends_with_the_last():
    servers = [socket.create_server(("127.0.0.1", 0)) for _ in range(3)]
    try:
        t0 = time.monotonic()
        got = probe_round_trips({f"p{i}": s.getsockname() for i, s in enumerate(servers)})
        assert set(got) == {"p0", "p1", "p2"}
        assert time.monotonic() - t0 < PROBE_MIN_S  # no wait once all have answered
    finally:
        for s in servers:
            s.close()


@given(st.lists(st.floats(0, 1.2), max_size=40).map(sorted), st.integers(0, 300))
def test_the_probes_wait_is_bounded_and_waits_for_no_one_once_all_answered(after, targets):
    after = after[:targets]
    # only answers that came before the wait ended are taken (as probe_round_trips takes them)
    assume(all(t <= probe_wait_s(after[:i], targets) for i, t in enumerate(after)))
    wait = probe_wait_s(after, targets)
    if len(after) == targets:
        assert wait == (after[-1] if after else 0.0)  # every one answered (or none probed): no wait
    else:
        assert PROBE_MIN_S <= wait <= PROBE_MAX_S
        assert wait >= (after[-1] if after else PROBE_MAX_S)  # never before an answer it took
        if after and len(after) + 1 < targets:
            assert probe_wait_s(after + [after[-1]], targets) >= wait  # a further answer never cuts it short


def test_probe_candidates_are_direct_unmeasured_peers_of_the_range_and_bounded():
    spans = [Span("a", 0, 10), Span("b", 10, 20), Span("c", 20, 30, relayed=True), Span("d", 30, 40),
             Span("e", 0, 40, departing=True), Span("a", 10, 20)]
    chosen = probe_candidates(spans, 0, 30, out={"b"}, measured={})
    assert [s.peer_id for s in chosen] == ["a"]  # b set aside, c relayed, d outside, e departing, a once
    assert probe_candidates(spans, 0, 30, out=set(), measured={"a": 5.0}) == [spans[1]]
    crowd = [Span(f"x{i}", 0, 30) for i in range(MAX_PROBES + 100)]
    assert len(probe_candidates(crowd, 0, 30, out=set(), measured={})) == MAX_PROBES
