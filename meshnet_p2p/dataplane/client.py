"""The client side of the data plane: a TLS channel pinned to one peer's
certificate (direct, or through a relay's CONNECT splice), and a Session
stream wrapper with one reply per request.

The calls block: use them from plain threads, or from trio through
``trio.to_thread.run_sync`` (one thread per stream, not per message).
"""

from __future__ import annotations

import itertools
import queue
import uuid
from dataclasses import dataclass
from typing import Iterator, Sequence

import grpc

from .._proto import shard_runtime_pb2 as pb
from .._proto import shard_runtime_pb2_grpc as pb_grpc
from ..engine.contract import TensorBundle
from ..errors import MeshnetError
from ..identity import PeerId
from .relay import relay_target
from .server import CHANNEL_OPTIONS
from .tensors import bundle_from_proto, bundle_to_proto
from .tls import TLS_NAME

_CLOSE = object()


class ShardError(MeshnetError):
    """The peer answered with a typed error."""

    def __init__(self, error: pb.Error) -> None:
        self.code = error.code
        self.code_name = pb.ErrorCode.Name(error.code)
        self.detail = error.detail
        self.retryable = error.retryable
        self.terminal = error.terminal
        self.mismatches = list(error.mismatches)
        super().__init__(f"{self.code_name}: {error.detail}")


class ShardConnectionError(MeshnetError):
    """The connection failed: peer gone, TLS failure (wrong identity, tampering), timeout."""


def open_channel(cert_pem: bytes, *, address: tuple[str, int] | None = None, relay: tuple[str, int] | None = None,
                 peer_id: PeerId | None = None) -> grpc.Channel:
    """A channel that trusts only ``cert_pem``: direct to ``address``, or through
    ``relay`` to ``peer_id``."""
    options = CHANNEL_OPTIONS + [("grpc.ssl_target_name_override", TLS_NAME), ("grpc.enable_retries", 0)]
    if relay is not None:
        if peer_id is None:
            raise ValueError("a relayed channel needs the peer id")
        options.append(("grpc.http_proxy", f"http://{relay[0]}:{relay[1]}"))
        target = relay_target(peer_id)
    else:
        if address is None:
            raise ValueError("a direct channel needs an address")
        host, port = address
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        options.append(("grpc.enable_http_proxy", 0))
    return grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=cert_pem), options=options)


class ShardClient:
    def __init__(self, channel: grpc.Channel, *, timeout: float = 30.0) -> None:
        self.channel = channel
        self.stub = pb_grpc.ShardRuntimeStub(channel)
        self.timeout = timeout

    def _unary(self, method, request):
        try:
            return method(request, timeout=self.timeout)
        except grpc.RpcError as e:
            raise ShardConnectionError(f"{e.code().name}: {e.details()}") from None

    def capability(self) -> pb.Capability:
        return self._unary(self.stub.GetCapability, pb.CapabilityRequest())

    def health(self) -> pb.HealthReport:
        return self._unary(self.stub.Health, pb.HealthRequest())

    def cancel(self, session_id: str, work_id: str = "", reason: str = "") -> bool:
        return self._unary(self.stub.Cancel, pb.CancelRequest(session_id=session_id, work_id=work_id, reason=reason)).cancelled

    def release(self, session_id: str) -> bool:
        return self._unary(self.stub.Release, pb.ReleaseRequest(session_id=session_id)).released

    def session(self, fingerprint: pb.Fingerprint, *, max_tokens: int, session_id: str | None = None,
                route_epoch: int = 0, sampling: pb.Sampling | None = None, credits: int = 64,
                timeout: float | None = -1.0, record: bool = False) -> "SessionStream":
        """A Session stream. ``timeout`` bounds the whole stream (default: the
        client's timeout); None means no bound (a long generation), in which
        case the caller guards each step itself."""
        return SessionStream(self, fingerprint, max_tokens=max_tokens, session_id=session_id or uuid.uuid4().hex,
                             route_epoch=route_epoch, sampling=sampling or pb.Sampling(), credits=credits,
                             timeout=self.timeout if timeout == -1.0 else timeout, record=record)

    def close(self) -> None:
        self.channel.close()


@dataclass
class StepReply:
    position: int
    hidden: TensorBundle | None
    token_id: int | None
    is_eog: bool
    raw: pb.SessionResponse


class SessionStream:
    """One Session stream. ``step`` sends a step and returns its reply, raising
    :class:`ShardError` for a typed error and :class:`ShardConnectionError` if
    the stream breaks. Credit is topped up in-band before it runs out."""

    def __init__(self, client: ShardClient, fingerprint: pb.Fingerprint, *, max_tokens: int, session_id: str,
                 route_epoch: int, sampling: pb.Sampling, credits: int, timeout: float | None, record: bool = False) -> None:
        self.session_id = session_id
        self.route_epoch = route_epoch
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._steps = itertools.count(1)
        self._call = client.stub.Session(self._requests(), timeout=timeout)
        self._responses: Iterator[pb.SessionResponse] = iter(self._call)
        self.record = record
        self.responses: list[bytes] = []  # with record=True: every response as received, serialized
        accepted = self.request(pb.SessionRequest(open=pb.SessionOpen(
            session_id=session_id, route_epoch=route_epoch, fingerprint=fingerprint,
            proposed=pb.FlowControl(credits=credits), sampling=sampling, max_tokens=max_tokens)))
        if accepted.WhichOneof("kind") != "accepted":
            self.close()
            raise ShardConnectionError(f"unexpected reply to SessionOpen: {accepted.WhichOneof('kind')}")
        self.granted = accepted.accepted.granted
        self.credits = self.granted.credits
        self.layers = accepted.accepted.layers

    def _requests(self):
        while True:
            item = self._q.get()
            if item is _CLOSE:
                return
            yield item

    def send(self, request: pb.SessionRequest) -> None:
        self._q.put(request)

    def receive(self) -> pb.SessionResponse:
        try:
            resp = next(self._responses)
        except StopIteration:
            raise ShardConnectionError("the peer ended the session stream") from None
        except grpc.RpcError as e:
            raise ShardConnectionError(f"{e.code().name}: {e.details()}") from None
        if self.record:
            self.responses.append(resp.SerializeToString())
        if resp.WhichOneof("kind") == "error":
            raise ShardError(resp.error)
        return resp

    def request(self, request: pb.SessionRequest) -> pb.SessionResponse:
        self.send(request)
        return self.receive()

    def step(self, position: int, *, token_ids: Sequence[int] | None = None, hidden: TensorBundle | None = None,
             decode: bool = False, work_id: str = "", idempotency_step: int | None = None,
             deadline_ms: int = 0) -> StepReply:
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
        resp = self.request(request)
        kind = resp.WhichOneof("kind")
        if kind == "ack":
            return StepReply(position, None, None, False, resp)  # a duplicate: acknowledged, not applied
        r = resp.result
        hidden_out = bundle_from_proto(r.hidden) if r.HasField("hidden") and r.hidden.tensors else None
        return StepReply(r.position, hidden_out, r.token_id if r.has_token else None, r.is_eog, resp)

    def rollback(self, position: int, route_epoch: int | None = None) -> None:
        if route_epoch is not None:
            self.route_epoch = route_epoch
        self.request(pb.SessionRequest(rollback=pb.RollbackSignal(position=position, route_epoch=self.route_epoch)))

    def cancel(self, work_id: str = "", reason: str = "") -> None:
        """In-band cancel. The peer answers with a CANCELLED error (raised here)."""
        self.send(pb.SessionRequest(cancel=pb.CancelSignal(work_id=work_id, reason=reason)))

    def release(self) -> None:
        try:
            self.request(pb.SessionRequest(release=pb.ReleaseSignal()))
        finally:
            self.close()

    def close(self) -> None:
        self._q.put(_CLOSE)
        self._call.cancel()

    def __enter__(self) -> "SessionStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

