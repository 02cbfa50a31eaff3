"""Iterative Kademlia lookup, with the network call passed in.

Unlike round-based lookups, this one never waits for a whole round: it keeps
``alpha`` requests in flight and starts a new one the moment any finishes.
Each request has its own timeout, so a silent (frozen) peer costs one timeout
on one of the alpha slots while the others go on, and it is reported through
``on_fail`` so the routing table evicts it. A node is asked at most once per
lookup, and the number of requests is bounded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Generic, TypeVar

import trio

from .routing import Contact

R = TypeVar("R")


@dataclass
class LookupResult(Generic[R]):
    closest: list[Contact]  # the k closest nodes that answered
    responses: dict[int, R] = field(default_factory=dict)  # node id -> its answer
    queried: int = 0


async def iterative_lookup(
    target: int,
    seeds: list[Contact],
    call: Callable[[Contact], Awaitable[tuple[R, list[Contact]] | None]],
    *,
    k: int = 20,
    alpha: int = 3,
    timeout: float = 0.5,
    slow_after: float | None = None,
    on_fail: Callable[[Contact], None] = lambda c: None,
    on_abandon: Callable[[Contact], None] = lambda c: None,
    done: Callable[[dict[int, R]], bool] = lambda responses: False,
    max_queries: int | None = None,
) -> LookupResult[R]:
    """Find the ``k`` nodes closest to ``target``.

    ``call(contact)`` returns ``(answer, contacts it knows)`` or None on failure.
    ``done(responses)`` may end the lookup early (e.g. enough values found).

    A request unanswered after ``slow_after`` (default: a tenth of ``timeout``)
    stops holding one of the ``alpha`` slots and stops counting among the k
    closest, so a frozen peer delays nothing; if it answers before the lookup
    ends its answer is still used, and if it times out it is reported failed.
    The lookup ends when no request is in flight except slow ones and nothing
    closer is left to ask; slow requests are then abandoned, unless nobody has
    answered yet: then they are awaited until their timeout (a loaded host
    answers late; giving up would report an empty key).
    """
    max_queries = max_queries or 8 * k
    slow_after = timeout / 10 if slow_after is None else slow_after
    candidates: dict[int, Contact] = {c.node_id: c for c in seeds}
    state: dict[int, str] = {}  # node id -> pending | slow | ok | failed
    started: dict[int, float] = {}  # pending (not slow) requests: node id -> start time
    result: LookupResult[R] = LookupResult([])
    send, recv = trio.open_memory_channel[tuple[Contact, object]](math.inf)

    def dist(c: Contact) -> int:
        return c.node_id ^ target

    def next_up() -> list[Contact]:
        usable = sorted((c for c in candidates.values() if state.get(c.node_id) not in ("failed", "slow")), key=dist)[:k]
        return [c for c in usable if c.node_id not in state]

    async def query(c: Contact) -> None:
        answer = None
        with trio.move_on_after(timeout):
            answer = await call(c)
        send.send_nowait((c, answer))

    async with trio.open_nursery() as nursery:
        while True:
            for c in next_up()[: max(0, alpha - len(started))]:
                if result.queried >= max_queries:
                    break
                state[c.node_id] = "pending"
                started[c.node_id] = trio.current_time()
                result.queried += 1
                nursery.start_soon(query, c)
            if not started and (result.responses or "slow" not in state.values()):
                break
            # with nobody answered yet, the slow requests are all there is (a loaded host, not a
            # frozen one): wait for them, each bounded by its own timeout
            with trio.move_on_at(min(started.values()) + slow_after if started else math.inf):
                c, answer = await recv.receive()
                started.pop(c.node_id, None)
                if answer is None:
                    state[c.node_id] = "failed"
                    on_fail(c)
                    continue
                state[c.node_id] = "ok"
                value, contacts = answer
                result.responses[c.node_id] = value
                for n in contacts:
                    candidates.setdefault(n.node_id, n)
                if done(result.responses):
                    break
                continue
            now = trio.current_time()
            for node_id, t0 in list(started.items()):
                if t0 + slow_after <= now:
                    del started[node_id]
                    state[node_id] = "slow"
        nursery.cancel_scope.cancel()
    for node_id, s in state.items():
        if s in ("slow", "pending"):
            on_abandon(candidates[node_id])
    result.closest = sorted((candidates[i] for i, s in state.items() if s == "ok"), key=dist)[:k]
    return result
