"""The client side of the data plane: a channel pinned to one peer's TLS
certificate (direct, or through a relay's CONNECT splice), and a Session
stream wrapper with one reply per request. The protocol's own calls take and
return protobuf messages (tests speak the wire with them); the typed calls a
route uses (``peer_capability``, ``open_session``, ``link``, ``rollback``,
``attestation``) take and return the values of wire.py.

The calls block and do their own I/O on the calling thread (``channel.py``):
use them from plain threads, or from trio through ``trio.to_thread.run_sync``
(one thread per stream, not per message).
"""

from __future__ import annotations

import functools
import itertools
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Sequence

from google.protobuf.message import DecodeError

from meshnet_p2p._proto import shard_runtime_pb2 as pb
from meshnet_p2p.engine.contract import SamplingParams, TensorBundle
from meshnet_p2p.trust.attestation import Attestation
from meshnet_p2p.core.errors import MeshnetError, sanitize
from meshnet_p2p.core.identity import PeerId
from meshnet_p2p.dataplane.transport.channel import CallStream, Channel, ChannelError
from meshnet_p2p.dataplane.transport.pool import ChannelPool
from meshnet_p2p.dataplane.transport.connect import relay_target
from .wire import (
    Fingerprint,
    LinkOrder,
    PayloadError,
    PeerCapability,
    WireCommitment,
    attestation_from_proto,
    bundle_from_proto,
    bundle_to_proto,
    capability_from_proto,
    commitment_from_proto,
    fingerprint_to_proto,
    link_to_proto,
    method_path,
    rollback_to_proto,
    sampling_to_proto,
)
from meshnet_p2p.dataplane.transport.tls import TLS_NAME, TlsCredentials, default_client_credentials

class ShardError(MeshnetError):
    """The peer answered with a typed error."""

    def __init__(self, error: pb.Error) -> None:
        self.code = error.code
        self.code_name = pb.ErrorCode.Name(error.code)
        self.detail = error.detail
        self.retryable = error.retryable
        self.terminal = error.terminal
        self.mismatches = list(error.mismatches)
        self.retry_after_s = error.retry_after_ms / 1000  # a full peer's hint (0: none)
        self.work_id = error.work_id  # the step it refuses, when it refuses one
        self.idempotency_step = error.idempotency_step
        super().__init__(f"{self.code_name}: {sanitize(error.detail)}")  # the peer's words: escaped


class ShardConnectionError(MeshnetError):
    """The connection failed: peer gone, TLS failure (wrong identity, tampering), timeout.
    ``refused``: the peer turned the call away before any work (see ChannelError)."""

    def __init__(self, message: str, *, refused: bool = False) -> None:
        self.refused = refused
        super().__init__(message)

    @classmethod
    def of(cls, e: ChannelError) -> "ShardConnectionError":
        return cls(str(e), refused=e.refused)


ANONYMOUS = object()  # as ``client=``: present no client certificate (served within the anonymous budget)


def open_channel(cert_pem: bytes, *, address: tuple[str, int] | None = None, relay: tuple[str, int] | None = None,
                 peer_id: PeerId | None = None, client: TlsCredentials | None | object = None,
                 source_address: tuple[str, int] | None = None) -> Channel:
    """A channel that trusts only ``cert_pem``: direct to ``address``, or through
    ``relay`` to ``peer_id``. It connects on first use, presenting ``client``'s
    certificate (None: this process's, see ``default_client_credentials``;
    ANONYMOUS: none)."""
    creds = None if client is ANONYMOUS else client or default_client_credentials()
    extra = {"client_creds": creds, "source_address": source_address}
    if relay is not None:
        if peer_id is None:
            raise ValueError("a relayed channel needs the peer id")
        return Channel(cert_pem, TLS_NAME, relay=relay, relay_target=relay_target(peer_id), **extra)
    return Channel(cert_pem, TLS_NAME, address=address, **extra)  # it refuses a missing address


def lease_channel(pool: ChannelPool | None, cert_pem: bytes, *, peer_id: PeerId,
                  address: tuple[str, int] | None = None, relay: tuple[str, int] | None = None,
                  client: TlsCredentials | None = None) -> tuple[Channel, Callable[[], None] | None]:
    """A channel as :func:`open_channel` opens it, from ``pool`` when given (one
    connection per peer, way of reaching it and identity presented); and the
    function that gives it back (None: the caller owns the channel and closes it)."""
    make = functools.partial(open_channel, cert_pem, address=address, relay=relay, peer_id=peer_id, client=client)
    if pool is None:
        return make(), None
    return pool.lease((str(peer_id), cert_pem, address, relay, id(client)), make)


def open_attach(channel: Channel, session_id: str, attach_token: bytes, route_epoch: int, timeout: float, *,
                call_timeout: float | None = None) -> tuple[CallStream, pb.SessionResponse | None]:
    """A stream that attaches to the peer's open ``session_id`` (the ring), and its
    first answer (None: the stream ended unanswered). Raises ChannelError, or
    DecodeError for garbage; the caller ends the stream."""
    call = channel.stream(method_path("Session"), timeout=call_timeout, with_first_message=True)
    try:
        call.send(pb.SessionRequest(attach=pb.AttachOpen(session_id=session_id, attach_token=attach_token,
                                                         route_epoch=route_epoch)).SerializeToString())
        raw = call.recv(deadline=time.monotonic() + timeout)
        return call, (pb.SessionResponse.FromString(raw) if raw is not None else None)
    except BaseException:
        call.cancel()
        raise


def _parse(message_type, raw: bytes):
    try:
        return message_type.FromString(raw)
    except DecodeError:
        raise ShardConnectionError(f"the peer sent a malformed {message_type.__name__}") from None


class ShardClient:
    """Calls to one peer. ``release``: given when the channel is a pool's lease
    (pool.py), called on close instead of closing the shared channel."""

    def __init__(self, channel: Channel, *, timeout: float = 30.0, release=None) -> None:
        self.channel = channel
        self.timeout = timeout
        self._release = release

    def _unary(self, method: str, request, reply_type):
        try:
            raw = self.channel.unary(method_path(method), request.SerializeToString(), timeout=self.timeout)
        except ChannelError as e:
            raise ShardConnectionError.of(e) from None
        return _parse(reply_type, raw)

    def capability(self) -> pb.Capability:
        return self._unary("GetCapability", pb.CapabilityRequest(), pb.Capability)

    def peer_capability(self) -> PeerCapability:
        """What the peer says it serves: its fingerprint and layers."""
        return capability_from_proto(self.capability())

    def health(self) -> pb.HealthReport:
        return self._unary("Health", pb.HealthRequest(), pb.HealthReport)

    def cancel(self, session_id: str, work_id: str = "", reason: str = "") -> bool:
        request = pb.CancelRequest(session_id=session_id, work_id=work_id, reason=reason)
        return self._unary("Cancel", request, pb.CancelResponse).cancelled

    def release(self, session_id: str) -> bool:
        return self._unary("Release", pb.ReleaseRequest(session_id=session_id), pb.ReleaseResponse).released

    def can_attach(self, session_id: str, attach_token: bytes, route_epoch: int, timeout: float) -> bool:
        """Whether the peer's session takes an attach with this secret now (the ring's
        check of a link refused as unreachable); the probe stream is closed at once."""
        try:
            call, first = open_attach(self.channel, session_id, attach_token, route_epoch, timeout,
                                      call_timeout=timeout)
        except (ChannelError, DecodeError):
            return False
        call.cancel()
        return first is not None and first.HasField("accepted")

    def session(self, fingerprint: pb.Fingerprint, *, max_tokens: int, session_id: str | None = None,
                route_epoch: int = 0, sampling: pb.Sampling | None = None, credits: int = 64,
                timeout: float | None = -1.0, record: bool = False, attach_token: bytes = b"") -> "SessionStream":
        """A Session stream. ``timeout`` bounds the whole stream (default: the
        client's timeout); None means no bound (a long generation), in which
        case the caller bounds each step (``step(timeout=...)``). ``attach_token``:
        the secret the ring's previous hop will attach with (docs/ring.md)."""
        return SessionStream(self, fingerprint, max_tokens=max_tokens, session_id=session_id or uuid.uuid4().hex,
                             route_epoch=route_epoch, sampling=sampling or pb.Sampling(), credits=credits,
                             timeout=self.timeout if timeout == -1.0 else timeout, record=record,
                             attach_token=attach_token)

    def open_session(self, fingerprint: Fingerprint, *, max_tokens: int, sampling: SamplingParams,
                     session_id: str | None = None, route_epoch: int = 0, timeout: float | None = -1.0,
                     attach_token: bytes = b"") -> "SessionStream":
        """:meth:`session` with typed values: what a route opens each hop with."""
        return self.session(fingerprint_to_proto(fingerprint), max_tokens=max_tokens, session_id=session_id,
                            route_epoch=route_epoch, sampling=sampling_to_proto(sampling), timeout=timeout,
                            attach_token=attach_token)

    def close(self) -> None:
        if self._release is not None:
            self._release()
        else:
            self.channel.close()


MAX_STALE_SKIPPED = 4096  # results of an older route a reader passes over before it calls the peer broken


def _reply(resp: pb.SessionResponse) -> "StepReply":
    r = resp.result
    try:
        hidden_out = bundle_from_proto(r.hidden) if r.HasField("hidden") and r.hidden.tensors else None
    except PayloadError as e:
        raise ShardConnectionError(f"the peer sent a bad tensor: {e}") from None
    if hidden_out is None and not r.has_token:
        raise ShardConnectionError("the peer's step reply carries neither a hidden state nor a token")
    return StepReply(r.position, hidden_out, r.token_id if r.has_token else None, r.is_eog, resp,
                     commitment_from_proto(r.commitment) if r.HasField("commitment") else None,
                     commitment_from_proto(r.upstream) if r.HasField("upstream") else None)


def _passed_over(resp: pb.SessionResponse, epoch: int, also: str | None) -> bool:
    """A response a reader of route ``epoch`` passes over: an older route's result, a
    duplicate step's acknowledgement, or any response of kind ``also``."""
    kind = resp.WhichOneof("kind")
    return kind == "result" and resp.result.route_epoch < epoch or kind == also or \
        kind == "ack" and resp.ack.duplicate


@dataclass
class StepReply:
    position: int
    hidden: TensorBundle | None
    token_id: int | None
    is_eog: bool
    raw: pb.SessionResponse
    # the peer's signed commitment to the step (trust/commitment.py), as the wire carried it: unverified
    commitment: WireCommitment | None = None
    upstream: WireCommitment | None = None  # the ring: the previous hop's, which the peer took the step with


class SessionStream:
    """One Session stream. ``step`` sends a step and returns its reply, raising
    :class:`ShardError` for a typed error and :class:`ShardConnectionError` if
    the stream breaks or a reply misses its deadline. Credit is topped up
    in-band before it runs out."""

    def __init__(self, client: ShardClient, fingerprint: pb.Fingerprint, *, max_tokens: int, session_id: str,
                 route_epoch: int, sampling: pb.Sampling, credits: int, timeout: float | None, record: bool = False,
                 attach_token: bytes = b"") -> None:
        self.session_id = session_id
        self.route_epoch = route_epoch
        self._steps = itertools.count(1)
        self.record = record
        self.responses: list[bytes] = []  # with record=True: every response exactly as received
        self._held: pb.SessionResponse | ShardConnectionError | None = None  # read ahead by wait_result
        try:
            self._call: CallStream = client.channel.stream(method_path("Session"), timeout=timeout, with_first_message=True)
        except ChannelError as e:
            raise ShardConnectionError.of(e) from None
        accepted = self.request(pb.SessionRequest(open=pb.SessionOpen(
            session_id=session_id, route_epoch=route_epoch, fingerprint=fingerprint,
            proposed=pb.FlowControl(credits=credits), sampling=sampling, max_tokens=max_tokens,
            attach_token=attach_token)))
        if accepted.WhichOneof("kind") != "accepted":
            self.close()
            raise ShardConnectionError(f"unexpected reply to SessionOpen: {accepted.WhichOneof('kind')}")
        a = accepted.accepted
        if (a.session_id, a.route_epoch) != (session_id, route_epoch):  # the peer must accept what we opened
            self.close()
            raise ShardConnectionError(f"the peer accepted session {a.session_id!r} at epoch {a.route_epoch}, "
                                       f"not {session_id!r} at {route_epoch}")
        self.granted = a.granted
        self.credits = self.granted.credits
        self.layers = a.layers

    def send(self, request: pb.SessionRequest) -> None:
        try:
            self._call.send(request.SerializeToString())
        except ChannelError as e:
            raise ShardConnectionError.of(e) from None

    def readable(self, timeout: float) -> bool:
        """Whether a response (or the stream's end) is there within ``timeout``; unlike
        :meth:`receive`, running out cancels nothing."""
        return self._held is not None or self._call.wait_readable(timeout)

    def wait_result(self, epoch: int, timeout: float) -> bool:
        """Whether what :meth:`next_result` would read for route ``epoch`` (a result, an
        error, the stream's end) is there within ``timeout``. What it passes over (results
        of an older route, acknowledgements) is read meanwhile; unlike :meth:`receive`,
        running out cancels nothing. A ring's client waits so, to judge which hop is late."""
        deadline = time.monotonic() + timeout
        for _ in range(MAX_STALE_SKIPPED):
            if self._held is None:
                if not self._call.wait_readable(max(0.0, deadline - time.monotonic())):
                    return False
                try:
                    self._held = self._read(0.0)
                except ShardConnectionError as e:  # the stream's end: next_result raises it
                    self._held = e
            if not (isinstance(self._held, pb.SessionResponse) and _passed_over(self._held, epoch, "ack")):
                return True
            self._held = None
        return True  # next_result calls the peer broken

    def ended(self) -> bool:
        """Whether this stream has ended or its connection broke (a peer that died), from
        what has already arrived, without waiting; responses may still be queued before the end."""
        return isinstance(self._held, ShardConnectionError) or self._call.ended()

    def _read(self, timeout: float | None) -> pb.SessionResponse:
        try:
            raw = self._call.recv(deadline=None if timeout is None else time.monotonic() + timeout)
        except ChannelError as e:
            raise ShardConnectionError.of(e) from None
        if raw is None:
            raise ShardConnectionError("the peer ended the session stream")
        if self.record:
            self.responses.append(raw)
        return _parse(pb.SessionResponse, raw)

    def receive(self, timeout: float | None = None) -> pb.SessionResponse:
        held, self._held = self._held, None
        if isinstance(held, ShardConnectionError):
            raise held
        resp = held if held is not None else self._read(timeout)
        if resp.WhichOneof("kind") == "error":
            raise ShardError(resp.error)
        return resp

    def request(self, request: pb.SessionRequest, timeout: float | None = None) -> pb.SessionResponse:
        self.send(request)
        return self.receive(timeout)

    def step(self, position: int, *, token_ids: Sequence[int] | None = None, hidden: TensorBundle | None = None,
             decode: bool = False, work_id: str = "", idempotency_step: int | None = None,
             deadline_ms: int = 0, timeout: float | None = None) -> StepReply:
        """``timeout``: seconds to wait for the reply (a frozen peer surfaces as
        ShardConnectionError); ``deadline_ms``: the wall-clock deadline the peer enforces."""
        n, work_id = self.send_step(position, token_ids=token_ids, hidden=hidden, decode=decode, work_id=work_id,
                                    idempotency_step=idempotency_step, deadline_ms=deadline_ms)
        resp = self.receive(timeout)
        # What a peer answers is checked like any network input: a reply that is
        # not this step's is the peer's fault, a typed error failover handles.
        kind = resp.WhichOneof("kind")
        if kind == "ack":
            if not (resp.ack.duplicate and resp.ack.idempotency_step == n):
                raise ShardConnectionError("the peer acknowledged a step instead of answering it")
            return StepReply(position, None, None, False, resp)  # a duplicate: acknowledged, not applied
        if kind != "result":
            raise ShardConnectionError(f"the peer answered a step with {kind or 'nothing'}")
        r = resp.result
        if r.idempotency_step not in (0, n) or (r.work_id and r.work_id != work_id):
            raise ShardConnectionError("the peer answered another step than the one sent")
        return _reply(resp)

    def next_result(self, epoch: int, timeout: float | None = None) -> StepReply:
        """The next step result of route ``epoch`` (a ring's copy, or the reply to
        a step sent): results of an older route, still on their way, are passed over."""
        resp = self._skip_older(epoch, timeout, also="ack")
        kind = resp.WhichOneof("kind")
        if kind != "result":
            raise ShardConnectionError(f"the peer sent {kind or 'nothing'} where a step result belongs")
        if resp.result.route_epoch > epoch:
            raise ShardConnectionError("the peer sent a result of a route this client never announced")
        return _reply(resp)

    def signal(self, request: pb.SessionRequest, epoch: int, timeout: float | None = None) -> pb.SessionResponse:
        """Send a rollback or link and return its acknowledgement, passing over
        the ring's copies of an older route still on their way."""
        self.send(request)
        resp = self._skip_older(epoch, timeout)
        if resp.WhichOneof("kind") != "ack":
            raise ShardConnectionError(f"the peer answered a {request.WhichOneof('kind')} with "
                                       f"{resp.WhichOneof('kind') or 'nothing'}")
        return resp

    def link(self, order: LinkOrder, timeout: float | None = None) -> None:
        """Tell the peer where this session's output goes (the ring); returns once acknowledged."""
        self.signal(link_to_proto(order), order.route_epoch, timeout)

    def rollback(self, position: int, route_epoch: int, attach_token: bytes, timeout: float | None = None) -> None:
        """Roll the session back to ``position`` on route ``route_epoch``, the previous
        hop to attach with ``attach_token`` from now on; returns once acknowledged."""
        self.signal(rollback_to_proto(position, route_epoch, attach_token), route_epoch, timeout)

    def _skip_older(self, epoch: int, timeout: float | None, also: str | None = None) -> pb.SessionResponse:
        """The next response that is not a result of a route older than ``epoch`` (the
        ring's copies still on their way), nor of kind ``also``, nor the acknowledgement of
        a duplicate step (a ring step the client fed that the ring had fed already: never
        the answer to a rollback or a link, which would otherwise each take the answer
        meant for the one before)."""
        for _ in range(MAX_STALE_SKIPPED):
            resp = self.receive(timeout)
            if not _passed_over(resp, epoch, also):
                return resp
        raise ShardConnectionError("the peer sent too many results of an older route")

    def send_step(self, position: int, *, token_ids: Sequence[int] | None = None, hidden: TensorBundle | None = None,
                  decode: bool = False, work_id: str = "", idempotency_step: int | None = None,
                  deadline_ms: int = 0) -> tuple[int, str]:
        """Send a step without waiting for its reply; returns its idempotency step and work id."""
        if self.credits <= self.granted.credits // 2:
            self.send(pb.SessionRequest(credit=pb.CreditTopUp(credits=self.granted.credits - self.credits)))
            self.credits = self.granted.credits
        n = next(self._steps) if idempotency_step is None else idempotency_step
        request = pb.SessionRequest()
        msg = request.step  # built in place: wrapping a finished Step would copy its payload
        msg.work_id = work_id or f"w{n}"
        msg.idempotency_step = n
        msg.route_epoch = self.route_epoch
        msg.position = position
        msg.decode = decode
        msg.deadline_unix_ms = deadline_ms
        if token_ids is not None:
            msg.token_ids.extend(token_ids)
        if hidden is not None:
            bundle_to_proto(hidden, out=msg.hidden)
        self.credits -= 1
        self.send(request)
        return n, msg.work_id

    def attest(self, timeout: float | None = None) -> pb.Attestation:
        """The peer's signed statement of what this session computed so far."""
        resp = self.request(pb.SessionRequest(attest=pb.AttestSignal()), timeout)
        if resp.WhichOneof("kind") != "attestation":
            raise ShardConnectionError(f"unexpected reply to an attest request: {resp.WhichOneof('kind')}")
        return resp.attestation

    def attestation(self, timeout: float | None = None) -> Attestation:
        """:meth:`attest` as the trust layer's value (its signature not checked here)."""
        return attestation_from_proto(self.attest(timeout))

    def cancel(self, work_id: str = "", reason: str = "") -> None:
        """In-band cancel. The peer answers with a CANCELLED error (raised by the next receive)."""
        self.send(pb.SessionRequest(cancel=pb.CancelSignal(work_id=work_id, reason=reason)))

    def release(self, timeout: float | None = None) -> None:
        try:
            self.request(pb.SessionRequest(release=pb.ReleaseSignal()), timeout)
        finally:
            self.close()

    def close(self) -> None:
        self._call.cancel()

    def __enter__(self) -> "SessionStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
