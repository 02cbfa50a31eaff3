"""A ring hop's side of the route (docs/ring.md): its link to the next hop.

A client that opened a session on every hop sends each one a LinkSignal: the
next hop's address (or relay), pinned certificate, session and attach token.
The hop dials it with its own identity, opens a Session stream whose first
message attaches to that session, and from then on forwards each computed
step's output along it (the tail: its sampled token, as the head's next
decode step) without waiting for a reply. The next hop answers an attach
stream only with errors; a reader thread here drains them, so a link that
went bad stops forwarding and the client, which watches every hop's copies,
fails over.

What the forwarding rule is, is a pure function (:func:`forwards`); this
module is the dialing and sending around it.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time

from .._proto import shard_runtime_pb2 as pb
from ..errors import MeshnetError, sanitize
from ..identity import PeerId
from ..multiaddr import Multiaddr
from .channel import ChannelError
from .client import lease_channel, open_attach
from .pool import ChannelPool
from .tls import TlsCredentials, cert_identity

log = logging.getLogger(__name__)

ATTACH_TOKEN_BYTES = 32  # what a client draws per hop; longer ones are refused
MAX_LINKS_PER_SESSION = 16  # dials one session may ask for (each failover relinks the ring once)
LINK_TIMEOUT_S = 5.0  # dial, TLS and attach to the next hop
DRAIN_WAKE_S = 1.0  # how often a link's reader looks whether the link was closed
FORWARD_TIMEOUT_S = 2.0  # a next hop that grants no window this long is given up (the client fails it over)


class LinkError(MeshnetError):
    """The link names no reachable hop, or the next hop refused to attach.
    ``full``: it turned the attach away for want of a worker (busy, not faulty)."""

    def __init__(self, message: str, *, full: bool = False) -> None:
        self.full = full
        super().__init__(message)


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

    def __init__(self, msg: pb.LinkSignal, creds: TlsCredentials | None, pool: ChannelPool) -> None:
        self.epoch = msg.route_epoch
        self.forward_until = msg.forward_until
        self.stop_at_eog = msg.stop_at_eog
        self.peer = _checked_peer(msg)
        self.error: str | None = None  # why the link stopped, once it has
        self._lock = threading.Lock()  # forwards from several handler threads go out one at a time
        if msg.relay:
            relay = _parse_addr(msg.relay, "relay")
            way = {"relay": (relay.host, relay.port)}
        else:
            addr = _parse_addr(msg.address, "address")
            if addr.peer_id not in (None, self.peer):
                raise LinkError("the link's address names another peer")
            way = {"address": (addr.host, addr.port)}
        # rings through the same next hop share one connection to it (pool.py)
        channel, self._release = lease_channel(pool, msg.tls_cert, peer_id=self.peer, client=creds, **way)
        channel.connect_timeout = LINK_TIMEOUT_S
        self._channel = channel
        self._call = None
        try:
            self._call, reply = open_attach(channel, msg.session_id, msg.attach_token, msg.route_epoch,
                                            LINK_TIMEOUT_S)
        except ChannelError as e:
            self.close()
            # the reason stays here: a client must not learn from a peer what answers at an address it chose
            log.info("ring: cannot reach %s: %s", self.peer, e)
            raise LinkError(f"cannot reach the next hop {self.peer}", full=e.refused) from None
        except Exception:  # a malformed reply
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

    def forward(self, position: int, decode: bool, *, token_id: int | None = None,
                hidden: pb.TensorBundle | None = None) -> bool:
        """Send the next hop its step at ``position``; False once the link is broken."""
        request = pb.SessionRequest()
        step = request.step
        step.idempotency_step = position + 1  # ring steps are numbered by position: both feeders agree
        step.route_epoch = self.epoch
        step.position = position
        step.decode = decode
        if token_id is not None:
            step.token_ids.append(token_id)
        else:
            step.hidden.CopyFrom(hidden)
        with self._lock:
            if self.error is not None:
                return False
            try:
                if self._credits <= self._granted // 2:
                    self._call.send(pb.SessionRequest(credit=pb.CreditTopUp(
                        credits=self._granted - self._credits)).SerializeToString())
                    self._credits = self._granted
                self._credits -= 1
                self._call.send(request.SerializeToString(), deadline=time.monotonic() + FORWARD_TIMEOUT_S)
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
                resp = pb.SessionResponse.FromString(raw)
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


def _checked_peer(msg: pb.LinkSignal) -> PeerId:
    try:
        peer = PeerId.from_string(msg.peer_id)
    except Exception:
        raise LinkError("the link names no valid peer id") from None
    try:
        holder = cert_identity(msg.tls_cert)
    except Exception:
        raise LinkError("the link's certificate is not a peer certificate") from None
    if holder != peer:
        raise LinkError("the link's certificate belongs to another peer")
    if not 0 < len(msg.attach_token) <= ATTACH_TOKEN_BYTES:
        raise LinkError("the link carries no usable attach token")
    if not msg.session_id or len(msg.session_id) > 128:
        raise LinkError("the link names no usable session")
    return peer


def _parse_addr(text: str, what: str) -> Multiaddr:
    try:
        addr = Multiaddr.parse(text)
    except Exception:
        raise LinkError(f"the link's {what} is not a multiaddr") from None
    if addr.transport != "tcp" or addr.host is None or addr.port is None:
        raise LinkError(f"the link's {what} is not a TCP address")
    return addr

