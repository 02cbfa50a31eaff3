"""Failing over: blaming the hop at fault (a failover spent, a ban unless it was
only busy), opening a replacement for its span of layers, replaying the span's
inputs into it (rebuilding its cache), and rolling a ring's other hops back to
the step that failed. Functions over a route (chain.py), shared by star and ring."""

from __future__ import annotations

import os

from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.dataplane.ring import ATTACH_TOKEN_BYTES
from meshnet_p2p.dataplane.stub import ShardConnectionError, ShardError

from .chain import Chain
from .errors import GenerationError, is_full
from .hop import Hop

Fault = tuple[int, MeshnetError]  # the index of the hop at fault, and why


def blame(route: Chain, hop: Hop, error: Exception, then: str) -> None:
    """Spend a failover on ``hop`` (GenerationError past the limit), ban its peer
    unless it was only full, say so, and close it."""
    route.failovers += 1
    if route.failovers > route.opts.max_failovers:
        raise GenerationError(f"gave up after {route.opts.max_failovers} failovers; last: {error}")
    if not is_full(error):  # full, not faulty: no ban
        route.search.ban(hop.span.peer_id)
    route.opts.on_event(f"peer {hop.span.peer_id} failed on layers {hop.span.start}-{hop.span.end - 1} "
                        f"({error}); {then}")
    route.retired.append(hop)  # what it answered before it failed may still be audited
    hop.close()


def replay(route: Chain, history: list[tuple[int, object, bool]], new_hops: list[Hop]) -> None:
    """Rebuild a replacement's caches: every step the failed hop was given, through its new hops."""
    for position, payload, decode in history:
        for hop in new_hops:
            payload = route.through(hop, position, payload, decode)


def replace_hop(route: Chain, index: int, error: Exception) -> None:
    """A star's failover: the hop at ``index`` replaced on a new route epoch, its inputs replayed."""
    failed = route.hops[index]
    blame(route, failed, error, "rerouting")
    route.search.survey()
    route.epoch += 1
    new_hops = route.search.open_chain(failed.span.start, failed.span.end, route.epoch)
    replay(route, failed.history, new_hops)
    route.hops[index : index + 1] = new_hops


def replace_failed(route: Chain, failed: set[int]) -> Fault | None:
    """Open a replacement for each failed hop and replay its inputs (from the
    last, so earlier indices stay put when one span takes several hops)."""
    for index in sorted(failed, reverse=True):
        old = route.hops[index]
        route.search.survey()
        new_hops = route.search.open_chain(old.span.start, old.span.end, route.epoch)
        try:
            replay(route, old.history, new_hops)
        except (ShardConnectionError, ShardError) as e:  # a replacement failed too: another round
            for hop in new_hops:
                if not is_full(e):
                    route.search.ban(hop.span.peer_id)
                hop.close()
            return index, e  # the failed hop stays in its place, its history with it
        route.hops[index : index + 1] = new_hops
        failed.discard(index)
    return None


def rollback_others(route: Chain, failed: set[int], position: int) -> Fault | None:
    """Roll every hop not in ``failed`` back to ``position`` on the route's new epoch,
    each with a new attach secret (the failed hop knew the old one of the hop after it)."""
    for j, hop in enumerate(route.hops):
        if j in failed:
            continue
        hop.stream.route_epoch = route.epoch  # the client's own steps go out on the new route too
        token = os.urandom(ATTACH_TOKEN_BYTES)
        try:
            hop.stream.rollback(position, route.epoch, token, timeout=route.opts.step_timeout)
        except (ShardConnectionError, ShardError) as e:
            return j, e
        hop.attach_token = token
    return None
