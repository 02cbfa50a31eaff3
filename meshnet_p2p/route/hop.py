"""One hop of a route: connecting to the peer its signed report names, checking
at first contact that it serves what it announced, and opening the route's
session on it. A hop keeps what it was given, for replay and attestation,
and what it answered with its signed commitment to each step: checked on the
spot against what was given and answered (:func:`check_commitment`, two
sha256s), its signatures later (:func:`commitments_of`)."""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field

from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.core.identity import PeerId
from meshnet_p2p.core.multiaddr import Multiaddr
from meshnet_p2p.dataplane.ring import ATTACH_TOKEN_BYTES
from meshnet_p2p.dataplane.stub import SessionStream, ShardClient, ShardConnectionError, StepReply, lease_channel
from meshnet_p2p.dataplane.transport.pool import ChannelPool
from meshnet_p2p.dataplane.transport.tls import TlsCredentials, cert_identity
from meshnet_p2p.dataplane.wire import Fingerprint, PeerCapability, recipe_fingerprint
from meshnet_p2p.swarm.placement import Span
from meshnet_p2p.trust.attestation import SEAM_DOMAIN, RowDigest
from meshnet_p2p.trust.commitment import Commitment, CommitmentError, hidden_digest, input_digest, token_digest

from .options import PeerMeasures, RouteOptions

CONNECT_TIMEOUT_S = 3.0  # a candidate's first contact (TCP, TLS, GetCapability)
ROUND_TRIP_SAMPLES = 3  # one round trip on a busy host was seen at 20x the link's, pricing an honest peer out


def connect(span: Span, timeout: float, client_creds: TlsCredentials | None = None,
            pool: ChannelPool | None = None) -> ShardClient:
    """A data-plane client for the peer of ``span``: direct, or through the relay
    its report names, with TLS pinned to the certificate its signed report carries,
    presenting ``client_creds`` (default: this process's client certificate).
    With ``pool``, on a channel shared with other sessions to the same peer."""
    c = span.record.content
    cert = c.get("tls_cert", "").encode()
    peer = PeerId.from_string(c["peer_id"])
    if cert_identity(cert) != peer:  # a report cannot pass off another peer's certificate
        raise MeshnetError(f"the TLS certificate in {peer}'s report belongs to another peer")
    if c.get("relay"):
        relay = Multiaddr.parse(c["relay"])
        way = {"relay": (relay.host, relay.port)}
    else:
        addr = Multiaddr.parse(c["addrs"][0])
        if addr.peer_id != peer:
            raise MeshnetError(f"report of {peer} advertises an address of another peer")
        way = {"address": (addr.host, addr.port)}
    channel, release = lease_channel(pool, cert, peer_id=peer, client=client_creds, **way)
    return ShardClient(channel, timeout=timeout, release=release)


def route_fingerprint(report: dict) -> Fingerprint:
    """The fingerprint a route opens every hop with: its model and recipe, each axis spelled out."""
    return recipe_fingerprint(report["model_digest"], report["recipe_digest"], report.get("recipe") or {})


def route_n_ubatch(report: dict, cap: PeerCapability) -> int:
    """The route's micro-batch size: from the report's axes (which hash to its
    recipe digest), else what the peer says; a peer cannot crash us with it."""
    value = (report.get("recipe") or {}).get("n_ubatch", cap.fingerprint.recipe_axes.get("n_ubatch"))
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if not 0 < n <= 1 << 16:
        raise MeshnetError(f"{report['peer_id']} states no usable n_ubatch ({str(value)[:20]!r})")
    return n


@dataclass
class Contact:
    span: Span
    client: ShardClient  # connected, its peer checked against its report
    cap: PeerCapability


@dataclass
class Hop:
    span: Span
    client: ShardClient
    stream: SessionStream
    n_ubatch: int  # the route's recipe: prefill steps must be whole micro-batches of it
    history: list[tuple[int, object, bool]] = field(default_factory=list)  # (position, input, decode)
    replies: list = field(default_factory=list)  # the peer's StepReply to each step of history (verify/transcript.py)
    attach_token: bytes = b""  # what the ring's previous hop attaches with (ring routes only)
    # what this hop was given and gave back, as the peer's attestation must state it
    inputs: RowDigest = field(default_factory=lambda: RowDigest(SEAM_DOMAIN))
    outputs: RowDigest = field(default_factory=lambda: RowDigest(SEAM_DOMAIN))
    steps: int = 0

    def close(self) -> None:
        try:
            self.stream.close()
        finally:
            self.client.close()


def first_contact(span: Span, opts: RouteOptions, measures: PeerMeasures) -> Contact:
    """Connect, and check the peer is what its report says (raises MeshnetError)."""
    c = span.record.content
    peer = PeerId.from_string(c["peer_id"])
    bound = min(opts.step_timeout, CONNECT_TIMEOUT_S)  # first contact: a short bound
    client = connect(span, bound, opts.client_creds, opts.pool)
    try:
        try:
            reused = client.channel.wire is not None  # a pooled connection, idle until now
            cap = client.peer_capability()  # also sets up the connection (TLS handshake)
        except ShardConnectionError:
            if not reused:
                raise
            # The peer may have closed it while it sat idle, its GOAWAY crossing our call (the
            # keep-alive race): that says nothing of the peer, so once more on a new connection.
            client.close()
            client = connect(span, bound, opts.client_creds, opts.pool)
            cap = client.peer_capability()
        client.timeout = opts.step_timeout
        for _ in range(ROUND_TRIP_SAMPLES):  # used when re-planning: the least of a few (~1 ms each)
            t0 = time.perf_counter()
            client.health()
            measures.round_trip(span.peer_id, (time.perf_counter() - t0) * 1000)
        if cap.fingerprint.model_digest != c["model_digest"] or cap.fingerprint.recipe_digest != c["recipe_digest"]:
            raise MeshnetError(f"{peer} serves another model or recipe than it announced")
        if (cap.start, cap.end) != (span.start, span.end):
            raise MeshnetError(f"{peer} serves other layers than it announced")
    except BaseException:
        client.close()
        raise
    return Contact(span, client, cap)


def open_hop(contact: Contact, opts: RouteOptions, epoch: int) -> Hop:
    """Open the route's session on a contacted peer."""
    c, client = contact.span.record.content, contact.client
    token = os.urandom(ATTACH_TOKEN_BYTES) if opts.ring else b""
    try:
        # open with the route's fingerprint, not the peer's: a peer of another recipe refuses, naming the axes
        # each hop its own random session ID: no peer on the route learns the ID another hop knows
        stream = client.open_session(route_fingerprint(c), max_tokens=opts.max_tokens, session_id=uuid.uuid4().hex,
                                     route_epoch=epoch, timeout=None, sampling=opts.sampling, attach_token=token)
    except BaseException:
        client.close()
        raise
    return Hop(contact.span, client, stream, route_n_ubatch(c, contact.cap), attach_token=token)


class DishonestHop(ShardConnectionError):
    """A hop's signed commitments contradict what it was given or answered, or each
    other, or a signature of it does not verify: ``peer_id`` is the hop at fault."""

    def __init__(self, peer_id: str, message: str) -> None:
        self.peer_id = peer_id
        super().__init__(message)


def output_digest(position: int, reply: StepReply) -> bytes:
    """What a reply to the step at ``position`` gave out, as its commitment digests it."""
    if reply.hidden is not None:
        return hidden_digest(position, reply.hidden)
    return token_digest(reply.position, reply.token_id, reply.is_eog)


def check_commitment(hop: Hop, position: int, payload, reply: StepReply) -> None:
    """On the spot (two sha256s, no signature): the reply's commitment, if the peer
    sends one, names what this client gave ``hop`` at ``position`` and got back,
    as the next step of its chain; raises DishonestHop otherwise. A peer that sends
    no commitment at all (an older build) is unverified, not refused."""
    w = reply.commitment
    if w is None:
        if hop.replies and hop.replies[0].commitment is not None:
            raise DishonestHop(hop.span.peer_id, f"{hop.span.peer_id} stopped committing to its steps")
        return
    if w.index != len(hop.replies) or w.input_digest != input_digest(position, payload) or \
            w.output_digest != output_digest(position, reply):
        raise DishonestHop(hop.span.peer_id, f"{hop.span.peer_id}'s commitment at position {position} does not "
                                             "name what it was given and answered")


def complete(hop: Hop, reply: StepReply, position: int, decode: bool, prev: bytes) -> Commitment:
    """The whole commitment a reply's wire form names, with what this client knows of the step."""
    c = hop.span.record.content
    return reply.commitment.complete(
        peer_id=hop.span.peer_id, model_digest=c["model_digest"], recipe_digest=c["recipe_digest"],
        route_epoch=reply.raw.result.route_epoch, session_id=hop.stream.session_id, start=hop.span.start,
        end=hop.span.end, position=position, decode=decode, prev=prev)


def commitments_of(hop: Hop, *, verify: bool = True) -> list[Commitment]:
    """Every commitment ``hop`` sent for the steps it kept, whole and chained (and with
    ``verify``, each signature checked: ~0.12 ms each); raises DishonestHop naming
    it for one that does not verify. Empty for a peer that sends none."""
    out: list[Commitment] = []
    prev = None
    for (position, _, decode), reply in zip(hop.history, hop.replies):
        if reply.commitment is None:
            if out:
                raise DishonestHop(hop.span.peer_id, f"{hop.span.peer_id} stopped committing to its steps")
            continue
        try:
            full = complete(hop, reply, position, decode, prev.link() if prev is not None else bytes(32))
        except CommitmentError as e:
            raise DishonestHop(hop.span.peer_id, f"{hop.span.peer_id} sent a malformed commitment: {e}") from None
        if not full.follows(prev) or (verify and not full.verifies()):
            raise DishonestHop(hop.span.peer_id, f"{hop.span.peer_id}'s commitment at position {position} "
                                                 "is not signed by it as the next of its chain")
        out.append(full)
        prev = full
    return out
