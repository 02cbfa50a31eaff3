"""Round trips to a route's candidates before its first plan, one TCP connect each.

A ring's time per token is its hop-to-hop links, and a report says nothing true of
where its peer is: planned blind, a fresh client's ring took 2-3x the fastest one
(bench/sim.py, docs/scale.md). Peers near the client are near each other, so its own
round trip to each candidate prices a plan well (1.1x the fastest ring at 1,000 peers,
p50, against 2.1x blind). A first
contact measures one in six round trips and a TLS handshake of the peer's CPU; a
TCP connect measures it in one, costing the peer an accepted socket. A report's
address that never answers (made up: a claim costs nothing) is known after the
probe's wait, not after a first contact's timeout each.

``probe_wait_s`` decides how long to wait (pure); ``probe_round_trips`` is the
network call (non-blocking connects on one selector, no thread per target).
"""

from __future__ import annotations

import errno
import random
import selectors
import socket
import time
from typing import Hashable

MAX_PROBES = 256  # candidates probed at once: one socket each, for one round trip
PROBES_PER_HOST = 4  # distinct ports of one IP probed (reports may all name one victim's address)
PROBE_ENOUGH = 8  # answers that make a first plan worth making...
PROBE_SLACK = 2.0  # ...waiting as long again as the PROBE_ENOUGH-th took, for peers a little farther
PROBE_MIN_S = 0.2  # waited at least (a near swarm answers in less; a lost SYN waits 1 s to be sent again)
PROBE_MAX_S = 1.0  # waited at most: past it, what has not answered is left out of the first plans


def probe_candidates(spans, start: int, end: int, out: set[str], measured) -> list:
    """Whom to probe for a route over [start, end): the peers of spans within it, not
    ``out`` (banned, set aside), not yet ``measured``, reached directly (a relayed
    peer's address is its relay's: a connect there measures half its way); at most
    MAX_PROBES, drawn at random past that (cheap claims, a liar's crowd among them,
    must not take every place)."""
    seen: set[str] = set()
    found = []
    for s in spans:
        if (s.relayed or s.peer_id in out or s.peer_id in measured or s.peer_id in seen
                or s.end <= start or s.start >= end or s.departing):
            continue
        seen.add(s.peer_id)
        found.append(s)
    if len(found) > MAX_PROBES:
        found = random.sample(found, MAX_PROBES)
    return found


def probe_wait_s(answered_after: list[float], targets: int) -> float:
    """How long after the probes went out to stop waiting, given when each answer so far
    came (seconds, in order): once every target answered, at once; else PROBE_SLACK times
    the latest answer's time up to the PROBE_ENOUGH-th (it only grows as answers come),
    within [PROBE_MIN_S, PROBE_MAX_S]; PROBE_MAX_S while none has answered. (Waiting for
    PROBE_ENOUGH answers when fewer candidates are alive cost a failover the whole bound.)"""
    if len(answered_after) >= targets:  # (none probed: no wait)
        return answered_after[-1] if answered_after else 0.0
    if not answered_after:
        return PROBE_MAX_S
    return min(PROBE_MAX_S, max(PROBE_MIN_S, PROBE_SLACK * answered_after[min(len(answered_after), PROBE_ENOUGH) - 1]))


def probe_round_trips(targets: dict[Hashable, tuple[str, int]]) -> dict[Hashable, float]:
    """Connect to every ``targets`` address at once (key -> (ip, port)) and return the
    round trip in ms of each key whose address accepted within ``probe_wait_s``; the connections
    are closed at once, nothing sent. A refusal or an unreachable address is not an answer."""
    sel = selectors.DefaultSelector()
    began = time.monotonic()
    out: dict[Hashable, float] = {}
    after: list[float] = []
    try:
        for peer, (host, port) in targets.items():
            try:
                sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            except OSError:
                continue  # out of descriptors: fewer probes, not a failed search
            sock.setblocking(False)
            sent = time.monotonic()
            if sock.connect_ex((host, port)) not in (0, errno.EINPROGRESS):
                sock.close()
                continue
            sel.register(sock, selectors.EVENT_WRITE, (peer, sent))
        probed = len(sel.get_map())
        while sel.get_map():
            left = began + probe_wait_s(after, probed) - time.monotonic()
            if left <= 0:
                break
            for key, _ in sel.select(left):
                sock, (peer, sent) = key.fileobj, key.data
                sel.unregister(sock)
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                    now = time.monotonic()
                    out[peer] = (now - sent) * 1000
                    after.append(now - began)
                sock.close()
    finally:
        for key in list(sel.get_map().values()):
            key.fileobj.close()
        sel.close()
    return out
