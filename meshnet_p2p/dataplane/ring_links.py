"""The servicer's side of a ring (docs/ring.md): a session's seat in it, and
the LinkSignals that ask this hop to dial the next one.

A seat is what a session holds for the ring: who may feed it (its attach
token), how its owner's stream is sent copies, and its link to the next hop.
``RingLinks.link`` answers a LinkSignal: it admits the link for its client
(link_guard.py: bounded per client, network and peer over time), checks the
signed report (ring.next_hop), dials at most once at a time per target and
leaves a target that failed alone for a while. Every failure before the next
hop proves its TLS identity is answered alike, and no earlier than
``link_answer_ms`` after the link came: a client learns nothing of what
answers at an address.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from meshnet_p2p.core.identity import Identity
from meshnet_p2p.dataplane.transport.pool import ChannelPool
from meshnet_p2p.dataplane.transport.tls import make_client_credentials
from .admission import Claimant
from .link_guard import LinkGuard
from .ring import MAX_LINKS_PER_SESSION, UNREACHED, LinkError, ReportRefused, RingLink, next_hop
from .wire import ErrorCode as E, reply_ack, reply_error

# A full peer's hint to ask again: sessions end as generations finish, seconds apart
# under load. The client backs off from it (and may go elsewhere meanwhile).
FULL_RETRY_AFTER_MS = 1000
DIAL_CERT_RENEW_S = 12 * 3600  # the ring's dials present a client certificate this young at most (it lasts 24 h)


@dataclass
class RingSeat:
    """A session's part in a ring: who may feed it, where its output goes."""

    attach_token: bytes = b""
    push: Callable[[object], None] | None = None  # sends the owner's stream a SessionResponse
    link: RingLink | None = None
    links: int = 0
    # One step (or rollback) of the session at a time, whichever stream it came on: a rollback
    # to a newer route must not slip between an older step's epoch check and its compute.
    lock: threading.Lock = field(default_factory=threading.Lock)
    _swap: threading.Lock = field(default_factory=threading.Lock)  # (unlink comes from any thread)

    def unlink(self) -> None:
        with self._swap:
            link, self.link = self.link, None
        if link is not None:
            link.close()

    def relink(self, link: RingLink) -> None:
        with self._swap:
            old, self.link = self.link, link
        if old is not None:
            old.close()


class RingLinks:
    """A peer's ring links to next hops: their connections (shared by sessions),
    how often they dial, and the certificate they dial with."""

    def __init__(self, *, caps, limits, stats, now_ms, identity: Identity | None) -> None:
        self.caps = caps
        self.limits = limits  # servicer.Limits: link_dial_ms, link_answer_ms, links
        self.stats = stats
        self.now_ms = now_ms
        self.identity = identity
        self._pool = ChannelPool()  # the ring's connections to next hops, shared by sessions
        self._guard = LinkGuard(limits.links)  # how often links dial, and what they leave alone
        self._guard_lock = threading.Lock()
        self._dialling: dict[object, threading.Event] = {}  # targets a link is dialling now: others wait for it
        self._creds_lock = threading.Lock()
        self._client_creds: tuple[float, object] = (0.0, None)  # (made at, the certificate the ring dials with)

    def close(self) -> None:
        """Close the connections to next hops (the server has stopped)."""
        self._pool.close()

    def link(self, session, who: Claimant, msg):
        """Dial the next hop ``msg`` (a LinkSignal) names and attach to its session:
        ``session``'s outputs (a servicer record: its epoch, its ring seat) go there
        from now on. Returns the SessionResponse to send."""
        came = time.monotonic()
        ring = session.ring
        if ring.push is None:
            return reply_error(E.PROTOCOL, "this server cannot send a ring's copies: it serves no ring")
        if msg.route_epoch < session.epoch:
            return reply_error(E.EPOCH_STALE, "link refused: it carries a stale route epoch")
        if ring.links >= MAX_LINKS_PER_SESSION:
            return reply_error(E.INVALID_ARGUMENT, f"a session is linked at most {MAX_LINKS_PER_SESSION} times")
        with self._guard_lock:
            admitted = self._guard.admit(who.host, who.client, came)
        if not admitted:  # counted over time, whichever session asks: sessions are free to open
            self.stats.links.add("limited")
            return reply_error(E.LINK_LIMITED, "this peer makes no more ring links for this client now",
                               retryable=True, retry_after_ms=FULL_RETRY_AFTER_MS)
        ring.links += 1  # a dial costs this peer, whatever comes of it: counted first
        c = self.caps
        try:
            hop = next_hop(msg, now_ms=self.now_ms(), model_digest=c.model_digest, recipe_digest=c.recipe_digest,
                           end=c.end, total=c.source_layers)
        except (LinkError, ReportRefused) as e:  # nothing was dialled: the reason tells of the message only
            self.stats.links.add("report_refused")
            return reply_error(E.INVALID_ARGUMENT, str(e))
        backing_off, mine = self._may_dial(hop.target, came)
        try:
            return self._dial(session, msg, hop, came, backing_off)
        finally:
            if mine is not None:  # the links waiting on this dial look again: backing off now, or not
                with self._guard_lock:
                    self._dialling.pop(hop.target, None)
                mine.set()

    def _may_dial(self, target, came: float) -> tuple[bool, threading.Event | None]:
        """(whether ``target`` is backing off, the event this link sets once its dial
        is over if it is the one dialling). While a link dials a target, the others
        to it wait for its outcome: a burst of links to one victim is one dial."""
        with self._guard_lock:
            dialling = self._dialling.get(target)
            if dialling is None:
                if not self._guard.may_dial(target, came):
                    return True, None
                mine = self._dialling[target] = threading.Event()
                return False, mine
        dialling.wait(self.limits.link_answer_ms / 1000)
        with self._guard_lock:
            return not self._guard.may_dial(target, time.monotonic()), None

    def _dial(self, session, msg, hop, came: float, backing_off: bool):
        ring = session.ring
        try:
            if backing_off:  # it failed lately: not dialled again, and answered as a failed dial is
                raise LinkError(UNREACHED, proven=False)
            link = RingLink(msg, hop, self.dial_credentials(), self._pool,
                            dial_timeout=self.limits.link_dial_ms / 1000)
        except LinkError as e:
            if not e.proven:
                self.stats.links.add("backing_off" if backing_off else "unreached")
                if not backing_off:
                    with self._guard_lock:
                        self._guard.failed(hop.target, time.monotonic())
                # the same answer at the same time, whether the port was closed, silent or closing
                time.sleep(max(0.0, came + self.limits.link_answer_ms / 1000 - time.monotonic()))
                return reply_error(E.LINK_FAILED, UNREACHED, retryable=True)
            self.stats.links.add("next_hop_refused")
            with self._guard_lock:
                self._guard.reached(hop.target)
            if e.full:  # the next hop has no worker to spare: busy, not faulty
                return reply_error(E.CAPACITY, str(e), retryable=True, retry_after_ms=FULL_RETRY_AFTER_MS)
            return reply_error(E.LINK_FAILED, str(e), retryable=True)
        self.stats.links.add("linked")
        with self._guard_lock:
            self._guard.reached(hop.target)
        with ring.lock:
            if msg.route_epoch < session.epoch:  # a rollback to a newer route came meanwhile
                link.close()
                return reply_error(E.EPOCH_STALE, "link refused: it carries a stale route epoch")
            ring.relink(link)
            session.epoch = msg.route_epoch
        return reply_ack()

    def dial_credentials(self):
        """This peer's identity as a client certificate, for the ring's next hop (None: the process's own)."""
        if self.identity is None:
            return None
        with self._creds_lock:
            made, creds = self._client_creds
            # the certificate lasts 24 h: a peer serving for days makes a new one twice a day
            if creds is None or time.monotonic() - made > DIAL_CERT_RENEW_S:
                creds = make_client_credentials(self.identity)
                self._client_creds = (time.monotonic(), creds)
            return creds
