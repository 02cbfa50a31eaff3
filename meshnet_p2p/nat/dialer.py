"""The dialer side of reachability checks: a DHT node's ``dial_back`` requests.

A role makes its DHT node a dialer with :func:`serve_dial_backs`, passing the
dial itself (``reachability.tls_dial_check``: the DHT knows no TLS). For each
request the dialer dials the asker's addresses back, only at the IP the
request came from and only once that address has shown it receives, within
bounds, and answers with a result it signs (:mod:`.dialback`). An address
through a relay (a relayed peer's circuit address) is dialled through that
relay, whoever asks: how a relayed peer learns that its relay carries others'
connections, not only its own (``dialback.may_dial``). Dials take
seconds, so a task in the node's nursery answers; refusals go at once. Its
counters (``dial_back_*``) are the node's stats, where metrics read them.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from typing import Awaitable, Callable

import trio

from meshnet_p2p.core.guard import Guard
from meshnet_p2p.core.identity import PeerId
from meshnet_p2p.core.netgroup import network_of
from meshnet_p2p.dht.node import Answer, DHTNode, Request
from meshnet_p2p.dht.wire import BadDatagram
from . import dialback

log = logging.getLogger(__name__)

MAX_DIALS_IN_FLIGHT = 8  # addresses being dialled at once, over every request
DIAL_BACKS_PER_SOURCE = 4  # dial_back requests one source IP may have answered per window...
DIAL_BACK_WINDOW_MS = 60_000  # ...of this long
MAX_DIAL_BACK_SOURCES = 4096  # source IPs whose recent requests are remembered
DIAL_TIMEOUT = 3.0  # one dial, connect and TLS handshake

# dial(requester, address) -> (answered with the requester's certificate?, why)
DialBack = Callable[[PeerId, str], Awaitable[tuple[bool, str]]]


def serve_dial_backs(node: DHTNode, dial: DialBack | None) -> "DialBackServer":
    """Answer ``node``'s dial_back requests, dialling with ``dial`` (None: refuse
    them all, "not a dialer", as a client-mode node does whatever it is given)."""
    server = DialBackServer(node, dial)
    node.serve_requests(dialback.DIAL_BACK, server)
    return server


class DialBackServer:
    """The handler (:data:`meshnet_p2p.dht.node.Handler`) for one node's dial_back requests."""

    def __init__(self, node: DHTNode, dial: DialBack | None) -> None:
        self.node = node
        self.dial = dial
        self.dials_in_flight = 0
        self._sources: OrderedDict[str, deque[int]] = OrderedDict()  # source network -> when it asked

    def __call__(self, request: Request) -> Answer | None:
        """BadDatagram if malformed; else the answer to send now (a refusal, a
        cookie, or a result that needed no dial), or None when a task dials and
        answers. In order: only a server-mode node with a dial function dials;
        only an IP, tcp, a port, the asker's /p2p; only from an address that has
        shown it receives (else a cookie: a spoofed source gets nothing dialled);
        per source IP 4 requests a minute; 8 dials at once."""
        msg, addr, stats = request.msg, request.addr, self.node.stats
        addrs, nonce = dialback.parse_dial_back(msg.body)
        targets = []
        for text in addrs:
            target, why = dialback.dial_target(text, msg.sender)
            if why == dialback.NOT_A_MULTIADDR:
                raise BadDatagram(f"addrs entry is not a multiaddr: {text[:80]!r}")
            targets.append((target, why))
        if self.dial is None or self.node.config.client_mode or not self.node.running:
            return self._refuse(dialback.NOT_A_DIALER)
        refusal = next((why for _, why in targets if why is not None), None)
        if refusal is not None:
            return self._refuse(refusal)
        if not request.proven:
            stats["dial_back_cookies"] += 1
            return self.node.cookie_answer(request)
        # the anti-abuse rule (libp2p AutoNAT's): dial only the IP the request came from, or a relay
        # the asker is reached through (dialback.may_dial)
        verdicts = [dialback.may_dial(t, addr[0]) for t, _ in targets]
        dial = [ok for ok, _ in verdicts]
        n = sum(dial)
        if self.dials_in_flight + n > MAX_DIALS_IN_FLIGHT:
            return self._refuse(dialback.BUSY)  # (not counted against the source: it got nothing)
        # per source network, not address: an IPv6 /64 or a /24 holds addresses by the thousand
        if not self._allowed(network_of(addr[0])):
            return self._refuse(dialback.RATE_LIMITED)
        stats["dial_back_accepted"] += 1
        stats["dial_back_not_from_source"] += len(addrs) - n
        undialled = [(a, False, why) for a, (_, why) in zip(addrs, verdicts)]
        if n == 0:  # nothing to dial: the answer is known now
            results = undialled
            stats["dial_back_served"] += 1
            return dialback.DIAL_RESULT, {"result": self._result_record(msg.sender, nonce, results, addr[0])}
        self.dials_in_flight += n
        self.node.start_soon(self._job, request, undialled, nonce, dial)
        return None

    def _refuse(self, reason: str) -> Answer:
        self.node.stats["dial_back_refused_" + reason.replace(" ", "_")] += 1
        return dialback.DIAL_RESULT, {"refused": reason}

    def _allowed(self, source: str) -> bool:
        """Count a request from ``source`` (an IP) unless it already made
        DIAL_BACKS_PER_SOURCE in the last DIAL_BACK_WINDOW_MS."""
        now = self.node.now_ms()
        recent = self._sources.get(source)
        if recent is None:
            while len(self._sources) >= MAX_DIAL_BACK_SOURCES:  # the least recently asking go first
                self._sources.popitem(last=False)
            recent = self._sources[source] = deque()
        self._sources.move_to_end(source)
        while recent and recent[0] <= now - DIAL_BACK_WINDOW_MS:
            recent.popleft()
        if len(recent) >= DIAL_BACKS_PER_SOURCE:
            return False
        recent.append(now)
        return True

    async def _job(self, request: Request, undialled: list[tuple[str, bool, str]], nonce: bytes,
                   dial: list[bool]) -> None:
        msg, addr = request.msg, request.addr
        async with Guard("dial_back", self.node.stats, backoff=False):  # a bug here costs one answer, never the node
            try:
                addrs = [a for a, _, _ in undialled]
                results = list(undialled)  # each dialled one's result replaces its entry

                async def one(i: int) -> None:
                    results[i] = (addrs[i], *await self._dial_one(msg.sender, addrs[i]))

                async with trio.open_nursery() as nursery:
                    for i in range(len(addrs)):
                        if dial[i]:
                            nursery.start_soon(one, i)
            finally:
                self.dials_in_flight -= sum(dial)
            body = {"result": self._result_record(msg.sender, nonce, results, addr[0])}
            self.node.stats["dial_back_served"] += 1
            await self.node.answer(request, dialback.DIAL_RESULT, body)  # (proven before any dial)

    async def _dial_one(self, requester: PeerId, addr_text: str) -> tuple[bool, str]:
        """One dial through the role's function, bounded; its failures are results."""
        stats = self.node.stats
        stats["dial_back_dials"] += 1
        outcome: tuple[bool, str] = (False, "timeout")
        with trio.move_on_after(DIAL_TIMEOUT):
            try:
                got = await self.dial(requester, addr_text)
            except Exception as e:  # the role's dialer must not take the node down
                log.warning("dial_back function failed on %s: %r", addr_text[:80], e)
                got = (False, "dial failed")
            if isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], bool) and isinstance(got[1], str):
                outcome = (got[0], got[1][:dialback.MAX_REASON_CHARS])
            else:
                outcome = (False, "dial failed")
        stats["dial_back_ok" if outcome[0] else "dial_back_failed"] += 1
        return outcome

    def _result_record(self, subject: PeerId, nonce: bytes, results: list[tuple[str, bool, str]],
                       observed: str) -> bytes:
        node = self.node
        return dialback.sign_dial_result(node.identity, subject, nonce, results, observed, now_ms=node.now_ms())
