"""Iterative Kademlia lookup, with the network call passed in.

Unlike round-based lookups, this one never waits for a whole round: it keeps
``alpha`` requests in flight and starts a new one the moment any finishes.
Each request has its own timeout, so a silent (frozen) peer costs one timeout
on one of the alpha slots while the others go on, and it is reported through
``on_fail`` so the routing table evicts it. A node is asked at most once per
lookup, and the number of requests is bounded.

Against one colluding group (S/Kademlia, and the IPFS DHT's diversity filter):

- **Disjoint paths.** With ``paths=d`` the seeds are dealt into d paths that
  run at once, each as above, and a node is asked by at most one path. A group
  that one path meets answers only with its own members, and captures that
  path; the others still reach the honest nodes near the target. ``responses``
  merges every path's answers; ``reached`` is the union of every path's
  closest (where a put stores).
- **Network diversity.** From one answer a path takes at most ``per_answer``
  contacts of one network (:func:`netgroup.ip_group`: an IPv4 /24, an IPv6
  /48), and a path's k closest hold at most ``per_path`` of one network, so
  identities minted on one host cannot push every honest node out of a path.
  Loopback, private and link-local addresses are exempt, as in the table.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Generic, Iterable, Sequence, TypeVar

import trio

from .routing import MAX_PER_GROUP, MAX_PER_GROUP_IN_BUCKET, Contact
from meshnet_p2p.core.netgroup import ip_group

R = TypeVar("R")
PER_ANSWER = MAX_PER_GROUP_IN_BUCKET  # contacts of one network taken from one answer
PER_PATH = MAX_PER_GROUP  # members of one network among a path's k closest
SLOW_FACTOR = 3.0  # round trips (the lookup's median) after which a request is slow, if beyond slow_after


@dataclass
class LookupResult(Generic[R]):
    closest: list[Contact]  # the k closest nodes that answered (over every path)
    responses: dict[int, R] = field(default_factory=dict)  # node id -> its answer
    queried: int = 0
    paths: list[list[Contact]] = field(default_factory=list)  # each path's k closest that answered
    target: int = 0

    @property
    def reached(self) -> list[Contact]:
        """Every path's k closest, nearest first: where a put stores."""
        union = {c.node_id: c for closest in self.paths for c in closest} or {c.node_id: c for c in self.closest}
        return sorted(union.values(), key=lambda c: c.node_id ^ self.target)


def diverse(contacts: Iterable[Contact], per_group: int | None) -> list[Contact]:
    """``contacts`` in order, keeping at most ``per_group`` of each network
    (exempt addresses are all kept; None keeps everything)."""
    if per_group is None:
        return list(contacts)
    taken: dict[str, int] = {}  # (a Counter's missing key is a Python call: this runs on every answer)
    out = []
    for c in contacts:
        g = ip_group(c.host)
        if g is not None:
            n = taken.get(g, 0)
            if n >= per_group:
                continue
            taken[g] = n + 1
        out.append(c)
    return out


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
    paths: int = 1,
    also: Sequence[Contact] = (),
    per_answer: int | None = PER_ANSWER,
    per_path: int | None = PER_PATH,
) -> LookupResult[R]:
    """Find the ``k`` nodes closest to ``target``.

    ``call(contact)`` returns ``(answer, contacts it knows)`` or None on failure.
    ``done(responses)`` may end a path early (e.g. enough values found); it
    sees that path's answers only, so one path cannot end the others.
    ``max_queries`` bounds each path's requests. ``also``: contacts asked
    directly, whatever their distance (where a key's signer keeps its records);
    their answers join ``responses``, their contacts are not followed.

    A request unanswered after ``slow_after`` (default: a tenth of ``timeout``), or
    after SLOW_FACTOR times the median round trip this lookup has seen if that is
    longer, stops holding one of the ``alpha`` slots and stops counting among the
    k closest, so a frozen peer delays nothing (the node whose ID is ``target``
    itself is waited for up to ``timeout``, and asked again once if its answer
    never came: it is what a node lookup is for); if it answers before the lookup
    ends its answer is still used, and if it times out it is reported failed.
    A path ends when no request is in flight except slow ones and nothing
    closer is left to ask; the lookup ends when every path has ended and the
    direct asks have answered or turned slow; slow requests are then abandoned.
    While nobody has answered at all, a path waits for its slow requests until
    their timeout instead (a loaded host answers late; giving up would report
    an empty key).
    """
    max_queries = max_queries or 8 * k
    slow = _Slow(timeout / 10 if slow_after is None else slow_after, timeout)
    result: LookupResult[R] = LookupResult([], target=target)
    claimed: dict[int, int] = {}  # node id -> the path that asked it (disjointness)
    ordered = sorted({c.node_id: c for c in seeds}.values(), key=lambda c: c.node_id ^ target)
    d = max(1, min(paths, len(ordered)))
    outcomes: list[tuple[list[Contact], dict[int, R], list[Contact]]] = [([], {}, []) for _ in range(d)]

    async def path(i: int) -> None:
        outcomes[i] = await _one_path(
            target, ordered[i::d], call, i, claimed, result, k=k, alpha=alpha, timeout=timeout,
            slow=slow, on_fail=on_fail, done=done, max_queries=max_queries,
            per_answer=per_answer, per_path=per_path)

    direct: dict[int, tuple[Contact, float]] = {}  # direct asks in flight: node id -> (contact, start)
    answered = trio.Event()

    async def ask(c: Contact) -> None:
        answer = None
        with trio.move_on_after(timeout):
            answer = await call(c)
        direct.pop(c.node_id, None)
        if answer is None:
            on_fail(c)
        else:
            result.responses.setdefault(c.node_id, answer[0])
        if not direct:
            answered.set()

    async with trio.open_nursery() as nursery:
        if also:
            for c in {c.node_id: c for c in also}.values():
                direct[c.node_id] = (c, trio.current_time())
                result.queried += 1
                nursery.start_soon(ask, c)
        async with trio.open_nursery() as walks:
            for i in range(d if ordered else 0):
                walks.start_soon(path, i)
        if direct:  # like any request: waited for until slow, then abandoned
            with trio.move_on_at(max(t0 for _, t0 in direct.values()) + slow.after):
                await answered.wait()
        abandoned = [c for c, _ in direct.values()]
        nursery.cancel_scope.cancel()
    for c in abandoned:
        on_abandon(c)
    result.paths = [closest for closest, _, _ in outcomes]
    for _, _, left in outcomes:
        for c in left:
            on_abandon(c)
    result.closest = sorted({c.node_id: c for p in result.paths for c in p}.values(),
                            key=lambda c: c.node_id ^ target)[:k]
    return result


class _Slow:
    """When an unanswered request counts as slow: after ``floor``, or SLOW_FACTOR
    round trips as this lookup measures them, whichever is longer (at most
    ``timeout``). A fixed tenth of a second suited loopback; on the internet,
    round trips of 100-350 ms are common, and a lookup that called every peer
    past 100 ms slow ended as soon as its near peers had answered, without the
    far ones that held the key (bench/sim.py, docs/scale.md)."""

    def __init__(self, floor: float, timeout: float) -> None:
        self.floor, self.timeout = floor, timeout
        self.after = floor
        self._rtts: list[float] = []

    def answered(self, rtt: float) -> None:
        self._rtts.append(rtt)
        median = sorted(self._rtts)[len(self._rtts) // 2]
        self.after = min(self.timeout, max(self.floor, SLOW_FACTOR * median))


async def _one_path(target: int, seeds: list[Contact], call, me: int, claimed: dict[int, int],
                    result: LookupResult, *, k: int, alpha: int, timeout: float, slow: _Slow,
                    on_fail, done, max_queries: int, per_answer: int | None, per_path: int | None,
                    ) -> tuple[list[Contact], dict[int, R], list[Contact]]:
    """One path: returns its k closest that answered, its answers, and the
    contacts it left waiting on (slow or pending) for the caller to abandon."""
    candidates: dict[int, Contact] = {c.node_id: c for c in seeds}
    groups: dict[int, str | None] = {i: ip_group(c.host) for i, c in candidates.items()}  # (read by every window)
    # (distance, node id) of every candidate, nearest first: a path's window is read off
    # its front on every answer, instead of sorting hundreds of candidates each time
    ranked: list[tuple[int, int]] = sorted((c.node_id ^ target, c.node_id) for c in candidates.values())
    state: dict[int, str] = {}  # node id -> pending | slow | ok | failed
    started: dict[int, float] = {}  # pending (not slow) requests: node id -> start time
    responses: dict[int, R] = {}
    queried = 0
    retried = False  # the target itself, asked again once
    send, recv = trio.open_memory_channel[tuple[Contact, object]](math.inf)

    def dist(c: Contact) -> int:
        return c.node_id ^ target

    def slow_after(node_id: int) -> float:
        # The node looked up is the one answer that matters, and only it holds its ID
        # (an ID equal to another's cannot be ground): waited for up to the timeout
        # though it is the far one (else a node lookup missed it 1-12 % of the time,
        # docs/scale.md). A lookup of a node that left pays for it (twice: asked again once).
        return timeout if node_id == target else slow.after

    def window(answered: bool, unasked: int = 0) -> list[Contact]:
        """The k nearest candidates that answered (or, not ``answered``: that this path
        may still ask or wait for), at most per_path of a network (as :func:`diverse`),
        read off the front of ``ranked``: called on every answer, and written out as
        one loop for it. With ``unasked``: only the first that many of them not yet
        asked (what the free slots take), read no further than they are."""
        out: list[Contact] = []
        fresh: list[Contact] = []
        taken: dict[str, int] = {}
        for _, i in ranked:
            s = state.get(i)
            if (s != "ok") if answered else (s in ("failed", "slow") or claimed.get(i, me) != me):
                continue
            if per_path is not None and (g := groups[i]) is not None:
                n = taken.get(g, 0)
                if n >= per_path:
                    continue
                taken[g] = n + 1
            out.append(candidates[i])
            if unasked and i not in state:
                fresh.append(candidates[i])
                if len(fresh) == unasked:
                    break
            if len(out) == k:
                break
        return fresh if unasked else out

    async def query(c: Contact) -> None:
        answer, t0 = None, trio.current_time()
        with trio.move_on_after(timeout):
            answer = await call(c)
        if answer is not None:
            slow.answered(trio.current_time() - t0)
        send.send_nowait((c, answer))

    async with trio.open_nursery() as nursery:

        def ask(c: Contact) -> None:
            nonlocal queried
            started[c.node_id] = trio.current_time()
            queried += 1
            result.queried += 1
            nursery.start_soon(query, c)

        while True:
            free = alpha - len(started)
            for c in window(answered=False, unasked=free) if free > 0 else ():
                if queried >= max_queries:
                    break
                claimed[c.node_id] = me
                state[c.node_id] = "pending"
                ask(c)
            if not started and (result.responses or "slow" not in state.values()):
                break
            # with nobody answered yet (on any path), the slow requests are all there is (a loaded
            # host, not a frozen one): wait for them, each bounded by its own timeout
            with trio.move_on_at(min(t0 + slow_after(i) for i, t0 in started.items()) if started
                                 else trio.current_time() + slow.after):
                c, answer = await recv.receive()
                started.pop(c.node_id, None)
                if answer is None and c.node_id == target and not retried:
                    # the one answer a node lookup is for, lost (a datagram either way): once more
                    retried = True
                    ask(c)
                    continue
                if answer is None:
                    state[c.node_id] = "failed"
                    on_fail(c)
                    continue
                state[c.node_id] = "ok"
                value, contacts = answer
                responses[c.node_id] = value
                result.responses[c.node_id] = value
                for n in diverse(sorted(contacts, key=dist), per_answer):
                    if n.node_id not in candidates:
                        candidates[n.node_id] = n
                        groups[n.node_id] = ip_group(n.host)
                        bisect.insort(ranked, (n.node_id ^ target, n.node_id))
                if done(responses):
                    break
                continue
            now = trio.current_time()
            for node_id, t0 in list(started.items()):
                if t0 + slow_after(node_id) <= now:
                    del started[node_id]
                    state[node_id] = "slow"
        nursery.cancel_scope.cancel()
    left = [candidates[i] for i, s in state.items() if s in ("slow", "pending")]
    closest = window(answered=True)
    return closest, responses, left
