"""The answer one DHT request waits for (dht/pending.py)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from meshnet_p2p.dht.pending import Pending


async def test_the_first_answer_wakes_the_waiter_and_a_later_one_is_dropped():
    p: Pending[str] = Pending()
    got = []

    async def waiter() -> None:
        got.append(await p.wait())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []
        assert p.set("first") and not p.set("second")
    assert got == ["first"] and p.answer == "first"


async def test_an_answer_that_came_before_the_wait_is_returned():
    p: Pending[str] = Pending()
    p.set("early")
    assert await p.wait() == "early"


async def test_a_wait_that_timed_out_leaves_nothing_behind_and_the_answer_is_kept():
    p: Pending[str] = Pending()
    with trio.move_on_after(0.01) as scope:
        await p.wait()
    assert scope.cancelled_caught
    assert p.set("late")  # nobody is woken (nobody waits); nothing raises
    assert await p.wait() == "late"


async def test_one_task_waits_at_a_time():
    p: Pending[str] = Pending()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(p.wait)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trio.BusyResourceError):
            await p.wait()
        nursery.cancel_scope.cancel()
