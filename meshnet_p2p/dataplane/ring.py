"""A ring hop's side of the route (docs/ring.md): its link to the next hop.

A client that opened a session on every hop sends each one a LinkSignal: the
next hop's signed capability report (what the client planned the route from),
its session and attach token. The hop checks the report (:func:`next_hop`: it
dials only what that report binds, never an address the client chose), dials
it with its own identity, opens a Session stream whose first
message attaches to that session, and from then on forwards each computed
step's output along it (the tail: its sampled token, as the head's next
decode step) without waiting for a reply. The next hop answers an attach
stream only with errors; a reader thread here drains them, so a link that
went bad stops forwarding and the client, which watches every hop's copies,
fails over.

What the forwarding rule is, and what a link may dial, are pure functions
(:func:`forwards`, :func:`next_hop`); this module is the dialing and sending
around them. How often a peer dials, and what it leaves alone after a failure:
link_guard.py.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from dataclasses import dataclass
from typing import Hashable

from meshnet_p2p.swarm.capability import CAPABILITY, CAPABILITY_TYPE
from meshnet_p2p.core.errors import MeshnetError, sanitize
from meshnet_p2p.core.identity import PeerId
from meshnet_p2p.core.multiaddr import Multiaddr
from meshnet_p2p.core.records import RecordRejected, RecordVerifier
from meshnet_p2p.dataplane.transport.channel import ChannelError
from .stub import lease_channel, open_attach
from .wire import credit_request, decode_response, forward_request
from meshnet_p2p.dataplane.transport.pool import ChannelPool
from meshnet_p2p.dataplane.transport.tls import TlsCredentials, cert_identity

log = logging.getLogger(__name__)

ATTACH_TOKEN_BYTES = 32  # what a client draws per hop; longer ones are refused
MAX_LINKS_PER_SESSION = 16  # dials one session may ask for (each failover relinks the ring once)
LINK_DIAL_S = 4.0  # TCP (and a relay's CONNECT) and TLS to the next hop...
LINK_TIMEOUT_S = 5.0  # ...and its attach; a link that fails before the TLS identity is proven is answered no
# earlier than this after it came, whatever answered at the address (link_guard.py, docs/ring.md)
UNREACHED = "cannot reach the next hop"  # the one answer to every failure before that
DRAIN_WAKE_S = 1.0  # how often a link's reader looks whether the link was closed
FORWARD_TIMEOUT_S = 2.0  # a next hop that grants no window this long is given up (the client fails it over)


class LinkError(MeshnetError):
    """The link names no reachable hop, or the next hop refused to attach.
    ``full``: it turned the attach away for want of a worker (busy, not faulty).
    ``proven``: the next hop proved its TLS identity before it failed (else the
    answer must say nothing of what answered at the address)."""

    def __init__(self, message: str, *, full: bool = False, proven: bool = True) -> None:
        self.full = full
        self.proven = proven
        super().__init__(message)


class ReportRefused(MeshnetError):
    """The link's report of the next hop is not one to dial: forged, stale, or not this ring's next hop."""


@dataclass(frozen=True)
class NextHop:
    """What a link dials, all of it from the next hop's signed report."""

    peer: PeerId
    cert_pem: bytes  # the TLS certificate the report binds to the peer
    address: tuple[str, int] | None  # direct...
    relay: tuple[str, int] | None  # ...or through the relay the report names

    @property
    def target(self) -> Hashable:
        """What a failed dial backs off from: the address, or the relay's circuit to this peer
        (a relay that turns one peer away still reaches the others)."""
        return ("tcp", *self.address) if self.relay is None else ("relay", *self.relay, str(self.peer))

    @property
    def way(self) -> dict:
        return {"relay": self.relay} if self.relay is not None else {"address": self.address}


_REPORTS = RecordVerifier({CAPABILITY: CAPABILITY_TYPE})  # verify(remember=False) only: it keeps no state


def next_hop(msg, *, now_ms: int, model_digest: str, recipe_digest: str, end: int,
             total: int) -> NextHop:
    """What ``msg`` may make this hop dial (layers [.., ``end``) of ``total``): the
    address or relay its next hop's signed, current report binds, with the
    certificate it binds; raises ReportRefused (or LinkError for the session
    fields) before anything is dialled."""
    if not 0 < len(msg.attach_token) <= ATTACH_TOKEN_BYTES:
        raise LinkError("the link carries no usable attach token")
    if not msg.session_id or len(msg.session_id) > 128:
        raise LinkError("the link names no usable session")
    if not msg.next_report:
        raise ReportRefused("the link carries no report of the next hop")
    try:
        record = _REPORTS.verify(msg.next_report, now_ms, remember=False)
    except RecordRejected as e:
        raise ReportRefused(f"the next hop's report is refused: {e.reason.value}") from None
    c = record.content  # validated: types, bounds, the addresses' form (capability.py)
    if str(record.signer) != msg.peer_id:
        raise ReportRefused("the next hop's report is signed by another peer than the link names")
    if c["departing"]:
        raise ReportRefused("the next hop's report says it is leaving")
    if (c["model_digest"], c["recipe_digest"]) != (model_digest, recipe_digest):
        raise ReportRefused("the next hop's report is of another model or recipe than this session's")
    if c["layers"][0] != (0 if end == total else end):
        raise ReportRefused("the next hop's report does not start where this hop's layers end")
    cert = c["tls_cert"].encode()
    try:
        if cert_identity(cert) != record.signer:
            raise ValueError
    except Exception:
        raise ReportRefused("the next hop's report carries a certificate of no peer or another") from None
    if c["relay"] is not None:  # validated: a direct tcp address
        relay = Multiaddr.parse(c["relay"])
        return NextHop(record.signer, cert, None, (relay.host, relay.port))
    addr = Multiaddr.parse(c["addrs"][0])  # validated: tcp, host, port, /p2p of the signer (a direct peer's own)
    return NextHop(record.signer, cert, (addr.host, addr.port), None)


def token_matches(expected: bytes, given: bytes) -> bool:
    return bool(expected) and hmac.compare_digest(expected, given)


def forwards(*, is_tail: bool, decode: bool, new_position: int, forward_until: int, is_eog: bool,
             stop_at_eog: bool) -> bool:
    """Whether a step's output goes on to the next hop. Every hop but the tail
    forwards everything; the tail forwards a decode step's token (the head's next
    step) while the generation wants more: below ``forward_until`` positions and,
    with ``stop_at_eog``, not after an end-of-generation token. The client sends
    the first decode step itself, so a prefill's token never loops round."""
    if not is_tail:
        return True
    return decode and new_position < forward_until and not (is_eog and stop_at_eog)


class RingLink:
    """An attached stream to the next hop's session; :meth:`forward` sends a step on it."""

    def __init__(self, msg, hop: NextHop, creds: TlsCredentials | None, pool: ChannelPool, *,
                 dial_timeout: float = LINK_DIAL_S) -> None:
        self.epoch = msg.route_epoch
        self.forward_until = msg.forward_until
        self.stop_at_eog = msg.stop_at_eog
        self.peer = hop.peer
        self.error: str | None = None  # why the link stopped, once it has
        self._lock = threading.Lock()  # forwards from several handler threads go out one at a time
        self._call = None
        self._release = lambda: None  # until a channel is leased
        try:
            reply = self._attach(msg, hop, creds, pool, dial_timeout)
        except ChannelError as e:
            channel = self._channel
            proven = channel.wire is not None  # the TLS handshake with the pinned certificate completed
            self.close()
            # the reason stays here: a client must not learn from a peer what answers at an address
            log.info("ring: cannot reach %s: %s", self.peer, e)
            if not proven:
                raise LinkError(UNREACHED, proven=False) from None
            raise LinkError(f"the next hop {self.peer} did not take the attach", full=e.refused) from None
        except Exception:  # a malformed reply (from the proven next hop)
            self.close()
            raise LinkError(f"the next hop {self.peer} answered the attach with garbage") from None
        if reply is None or reply.WhichOneof("kind") != "accepted":
            self.close()
            why = sanitize(reply.error.detail) if reply is not None and reply.HasField("error") else "no reply"
            raise LinkError(f"the next hop {self.peer} refused to attach: {why}")
        self._granted = max(1, reply.accepted.granted.credits)
        self._credits = self._granted
        self._reader = threading.Thread(target=self._drain, name="ring-link", daemon=True)
        self._reader.start()

    def _attach(self, msg, hop: NextHop, creds: TlsCredentials | None, pool: ChannelPool, dial_timeout: float):
        """Attach to the next hop's session; its first answer. Rings through the same
        next hop share one connection to it (pool.py). A pooled connection the next hop
        (or a NAT between) closed while it sat idle says nothing about the next hop:
        the attach is tried once more on a new connection."""
        for last in (False, True):
            channel, self._release = lease_channel(pool, hop.cert_pem, peer_id=hop.peer, client=creds, **hop.way)
            channel.connect_timeout = dial_timeout
            self._channel = channel
            reused = channel.wire is not None
            try:
                self._call, reply = open_attach(channel, msg.session_id, msg.attach_token, msg.route_epoch,
                                                LINK_TIMEOUT_S)
                return reply
            except ChannelError:
                if last or not reused:
                    raise
                self._release()  # broken: the pool drops it, and the next lease connects anew

    def forward(self, position: int, decode: bool, *, token_id: int | None = None,
                hidden=None, is_eog: bool = False, upstream=None) -> bool:
        """Write the next hop its step at ``position`` with ``upstream``, this hop's signed
        commitment to it (trust/commitment.py), as far as its flow-control window admits,
        without waiting for more: :meth:`flush` does, after the client's copy went out (a
        next hop that holds its window back must not hold this hop's copy back too).
        False once the link is broken."""
        request = forward_request(position, decode, self.epoch, token_id=token_id, hidden=hidden,
                                  upstream=upstream, is_eog=is_eog)
        with self._lock:
            if self.error is not None:
                return False
            try:
                if self._credits <= self._granted // 2:
                    self._call.send(credit_request(self._granted - self._credits), wait=False)
                    self._credits = self._granted
                self._credits -= 1
                self._call.send(request, wait=False)
            except ChannelError as e:
                self.error = f"forwarding to {self.peer} failed: {e}"
                return False
        return True

    def flush(self) -> bool:
        """Wait, at most FORWARD_TIMEOUT_S, until the forwards are all written (at
        once unless the next hop's window held one back); False once the link is broken."""
        with self._lock:
            if self.error is not None:
                return False
            try:
                self._call.flush(deadline=time.monotonic() + FORWARD_TIMEOUT_S)
            except ChannelError as e:
                self.error = f"forwarding to {self.peer} failed: {e}"
                return False
        return True

    def _drain(self) -> None:
        """Read what the next hop says on the attach stream: only errors, or its end.
        (This thread also reads the shared channel for everyone, answering the
        next hop's keepalive PINGs while no step goes out; it wakes every
        second to see whether the link was closed.)"""
        try:
            while True:
                if not self._call.wait_readable(DRAIN_WAKE_S):
                    if self.error is not None:  # closed meanwhile
                        return
                    continue
                raw = self._call.recv(deadline=None)
                if raw is None:
                    self.error = self.error or f"{self.peer} ended the attach stream"
                    return
                resp = decode_response(raw)
                if resp.HasField("error"):
                    log.info("ring: %s refused a forwarded step: %s", self.peer, sanitize(resp.error.detail))
                    if resp.error.terminal:
                        self.error = f"{self.peer}: {sanitize(resp.error.detail)}"
                        return
        except ChannelError as e:
            self.error = self.error or f"the link to {self.peer} broke: {e}"
        except Exception:
            self.error = self.error or f"{self.peer} sent garbage on the attach stream"

    def close(self) -> None:
        """End the attach stream (the shared channel stays, for other rings)."""
        self.error = self.error or "closed"
        if self._call is not None:
            self._call.cancel()
        self._release()
