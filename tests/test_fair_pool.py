"""The unary calls' worker pool (dataplane/fair_pool.py): sources take turns."""

import threading

import pytest

from meshnet_p2p.dataplane.transport.fair_pool import FairPool


def test_a_newcomer_waits_behind_one_job_per_source_not_the_whole_flood():
    pool = FairPool(1, per_source=8)
    started, release, order = threading.Event(), threading.Event(), []

    def first():
        started.set()
        release.wait(10)
        order.append("a0")

    assert pool.submit("a", first)
    assert started.wait(10)  # the only worker is busy: everything below queues
    for i in range(1, 9):
        assert pool.submit("a", lambda i=i: order.append(f"a{i}"))
    assert not pool.submit("a", lambda: order.append("a9"))  # the flooder's queue is full
    assert pool.submit("b", lambda: order.append("b0"))
    release.set()
    pool.shutdown()
    assert order[:3] == ["a0", "a1", "b0"] and order[3:] == [f"a{i}" for i in range(2, 9)]


def test_queued_jobs_run_at_shutdown_and_later_ones_are_refused():
    pool = FairPool(2, per_source=4)
    ran = []
    for i in range(4):
        pool.submit("a", lambda i=i: ran.append(i))
    pool.shutdown()
    assert sorted(ran) == [0, 1, 2, 3]
    with pytest.raises(RuntimeError):
        pool.submit("a", lambda: None)


def test_a_failing_job_does_not_kill_its_worker():
    pool = FairPool(1, per_source=4)
    done = threading.Event()
    pool.submit("a", lambda: 1 / 0)
    pool.submit("a", done.set)
    assert done.wait(10)
    pool.shutdown()
