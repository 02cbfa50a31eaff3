"""Tensor bundles on the wire: named tensors split into fragments, each tensor
checked for exact tiling and its CRC32C before anything uses its bytes; and
the typed values a client's calls take and return (fingerprint, sampling,
capability, ring link and rollback, attestation, step commitment), converted
here only."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import google_crc32c

from meshnet_p2p._proto import shard_runtime_pb2 as pb
from meshnet_p2p.engine.contract import SamplingParams, Tensor, TensorBundle
from meshnet_p2p.engine.seam import seam_itemsize
from meshnet_p2p.trust.attestation import Attestation
from meshnet_p2p.trust.commitment import Commitment

MAX_TENSORS = 8
MAX_FRAGMENTS = 1024
MAX_DIMS = 8


class PayloadError(ValueError):
    """A bundle that does not tile, fails its checksum, or is malformed."""


def crc32c(data: bytes) -> int:
    return google_crc32c.value(data)


def bundle_to_proto(bundle: TensorBundle, fragment_bytes: int = 1 << 20, out: pb.TensorBundle | None = None) -> pb.TensorBundle:
    """Fill ``out`` (a field of the message being built, to avoid a copy) or a new bundle."""
    out = pb.TensorBundle() if out is None else out
    for t in bundle.tensors:
        td = out.tensors.add(name=t.name, dtype=t.dtype, shape=list(t.shape), total_bytes=len(t.data), crc32c=crc32c(t.data))
        for off in range(0, max(len(t.data), 1), fragment_bytes):
            td.fragments.add(byte_offset=off, payload=t.data[off : off + fragment_bytes])
    return out


def bundle_from_proto(msg: pb.TensorBundle) -> TensorBundle:
    if not 0 < len(msg.tensors) <= MAX_TENSORS:
        raise PayloadError(f"a bundle carries 1..{MAX_TENSORS} tensors, this one {len(msg.tensors)}")
    tensors = []
    for td in msg.tensors:
        if len(td.fragments) > MAX_FRAGMENTS:
            raise PayloadError(f"tensor {td.name!r}: too many fragments")
        expected = 0
        parts = []
        fragments = td.fragments
        if len(fragments) > 1:
            fragments = sorted(fragments, key=lambda f: f.byte_offset)
        for frag in fragments:
            if frag.byte_offset != expected:
                kind = "gap" if frag.byte_offset > expected else "overlap"
                raise PayloadError(f"tensor {td.name!r}: fragment at {frag.byte_offset} does not tile ({kind} after {expected})")
            parts.append(frag.payload)
            expected += len(frag.payload)
        if expected != td.total_bytes:
            raise PayloadError(f"tensor {td.name!r}: fragments cover {expected} bytes, declared {td.total_bytes}")
        data = b"".join(parts)  # one part: that same object, no copy
        if crc32c(data) != td.crc32c:
            raise PayloadError(f"tensor {td.name!r}: CRC32C mismatch")
        if not 0 < len(td.shape) <= MAX_DIMS:  # before any arithmetic on it: a long shape costs quadratic time
            raise PayloadError(f"tensor {td.name!r}: a shape has 1..{MAX_DIMS} dimensions")
        shape = tuple(td.shape)
        try:
            itemsize = seam_itemsize(td.dtype)
        except KeyError:
            raise PayloadError(f"tensor {td.name!r}: unknown dtype {td.dtype[:16]!r}") from None
        if math.prod(shape) * itemsize != len(data):
            raise PayloadError(f"tensor {td.name!r}: {len(data)} bytes do not match shape {shape} of {td.dtype}")
        try:
            tensors.append(Tensor(td.name, td.dtype, shape, data))
        except ValueError as e:
            raise PayloadError(str(e)) from None
    try:
        return TensorBundle(tuple(tensors))
    except ValueError as e:
        raise PayloadError(str(e)) from None


# --- the service's side of ShardRuntime: requests decoded, replies built (servicer.py, ring.py) ---

SERVICE = pb.DESCRIPTOR.services_by_name["ShardRuntime"].full_name
ErrorCode = pb.ErrorCode  # the data plane's error codes: ints by name, ``ErrorCode.Name(code)`` for the name
_REQUESTS = {
    "GetCapability": pb.CapabilityRequest,
    "Health": pb.HealthRequest,
    "Cancel": pb.CancelRequest,
    "Release": pb.ReleaseRequest,
    "Session": pb.SessionRequest,
}


def method_path(method: str) -> str:
    """The gRPC path of one of the service's methods: ``/meshnet.shard.v1.ShardRuntime/Session``."""
    return f"/{SERVICE}/{method}"


def decode_request(method: str, raw: bytes):
    """A request of ``method`` (one of the service's); raises ValueError if malformed."""
    try:
        return _REQUESTS[method].FromString(raw)
    except Exception as e:  # protobuf's DecodeError, and whatever else a parser of hostile bytes may raise
        raise ValueError(f"a malformed {_REQUESTS[method].__name__}") from e


def decode_response(raw: bytes) -> pb.SessionResponse:
    """A Session stream's reply (what a ring link reads back from the next hop)."""
    return pb.SessionResponse.FromString(raw)


def encode(message) -> bytes:
    return message.SerializeToString()


def error_names() -> list[str]:
    return list(ErrorCode.keys())


def reply_error(code: int, detail: str, *, work_id: str = "", step: int = 0, retryable: bool = False,
                terminal: bool = False, mismatches: list[str] | None = None,
                retry_after_ms: int = 0) -> pb.SessionResponse:
    return pb.SessionResponse(error=pb.Error(code=code, detail=detail, retryable=retryable, work_id=work_id,
                                             idempotency_step=step, terminal=terminal, mismatches=mismatches or [],
                                             retry_after_ms=retry_after_ms))


def served_fingerprint(model_digest: str, recipe_digest: str, recipe: dict) -> pb.Fingerprint:
    """What this peer serves, in the form a client opens a session with."""
    return fingerprint_to_proto(recipe_fingerprint(model_digest, recipe_digest, recipe))


def layer_range(start: int, end: int, total: int) -> pb.LayerRange:
    return pb.LayerRange(start=start, end=end, total=total)


def flow_control(credits: int, max_message_bytes: int, max_prefill_tokens: int) -> pb.FlowControl:
    return pb.FlowControl(credits=credits, max_message_bytes=max_message_bytes, max_prefill_tokens=max_prefill_tokens)


def capability_reply(**fields) -> pb.Capability:
    """GetCapability's answer; ``fields`` as in proto/shard_runtime.proto's Capability."""
    return pb.Capability(**fields)


def health_reply(serving: bool, state: str, active_sessions: int, detail: str) -> pb.HealthReport:
    return pb.HealthReport(serving=serving, state=state, active_sessions=active_sessions, detail=detail)


def cancel_reply(cancelled: bool) -> pb.CancelResponse:
    return pb.CancelResponse(cancelled=cancelled)


def release_reply(released: bool) -> pb.ReleaseResponse:
    return pb.ReleaseResponse(released=released)


def reply_accepted(session_id: str, route_epoch: int, granted: pb.FlowControl,
                   layers: pb.LayerRange) -> pb.SessionResponse:
    return pb.SessionResponse(accepted=pb.SessionAccepted(session_id=session_id, route_epoch=route_epoch,
                                                          granted=granted, layers=layers))


def reply_ack(work_id: str = "", idempotency_step: int = 0, duplicate: bool = False) -> pb.SessionResponse:
    return pb.SessionResponse(ack=pb.Ack(work_id=work_id, idempotency_step=idempotency_step, duplicate=duplicate))


def reply_released(session_id: str) -> pb.SessionResponse:
    return pb.SessionResponse(released=pb.Released(session_id=session_id))


def reply_attestation(a) -> pb.SessionResponse:
    """A signed trust.attestation.Attestation, as a Session reply."""
    return pb.SessionResponse(attestation=pb.Attestation(
        peer_id=a.peer_id, session_id=a.session_id, model_digest=a.model_digest, recipe_digest=a.recipe_digest,
        start=a.start, end=a.end, steps=a.steps, input_digest=a.input_digest, output_digest=a.output_digest,
        signature=a.signature))


def reply_result(work_id: str, idempotency_step: int, position: int, route_epoch: int, *,
                 token=None, hidden: TensorBundle | None = None) -> pb.SessionResponse:
    """A computed step: its sampled ``token`` (an engine TokenOutput) or its ``hidden`` states
    (its commitments are added by :func:`commit_result` once signed)."""
    response = pb.SessionResponse()
    out = response.result  # built in place: wrapping a finished StepResult would copy its payload
    out.work_id = work_id
    out.idempotency_step = idempotency_step
    out.position = position
    out.route_epoch = route_epoch
    if token is not None:
        out.has_token = True
        out.token_id = token.token_id
        out.is_eog = token.is_eog
    else:
        bundle_to_proto(hidden, out=out.hidden)
    return response


def commit_result(response: pb.SessionResponse, commitment: Commitment | None,
                  upstream: Commitment | None = None) -> None:
    """Add this peer's signed commitment to a step's reply (what the client cannot know
    itself), and the previous hop's it accepted the step with (the ring: all of it)."""
    if commitment is not None:
        commitment_to_proto(commitment, response.result.commitment)
    if upstream is not None:
        commitment_to_proto(upstream, response.result.upstream, forwarded=True)


def commitment_to_proto(c: Commitment, out: pb.StepCommitment, *, forwarded: bool = False) -> pb.StepCommitment:
    out.index = c.index
    out.input_digest = c.input_digest
    out.output_digest = c.output_digest
    out.signature = c.signature
    if forwarded:  # what the next hop (or a client checking a relayed one) cannot know
        out.prev = c.prev
        out.session_id = c.session_id
        out.start = c.start
        out.end = c.end
        out.position = c.position
        out.decode = c.decode
    return out


def forward_request(position: int, decode: bool, route_epoch: int, *, token_id: int | None = None,
                    hidden: pb.TensorBundle | None = None, upstream: Commitment | None = None,
                    is_eog: bool = False) -> bytes:
    """A ring link's step for the next hop's session, numbered by position (both feeders agree),
    with the signed commitment of the step that computed it."""
    request = pb.SessionRequest()
    step = request.step
    step.idempotency_step = position + 1
    step.route_epoch = route_epoch
    step.position = position
    step.decode = decode
    if token_id is not None:
        step.token_ids.append(token_id)
        step.is_eog = is_eog
    else:
        step.hidden.CopyFrom(hidden)
    if upstream is not None:
        commitment_to_proto(upstream, step.upstream, forwarded=True)
    return request.SerializeToString()


def credit_request(credits: int) -> bytes:
    return pb.SessionRequest(credit=pb.CreditTopUp(credits=credits)).SerializeToString()


# --- the client's calls (dataplane/stub.py): typed values in and out ---------------------------------
# A client drives peers through these values, never through protobuf messages.


@dataclass(frozen=True)
class Fingerprint:
    """What a session is opened for: the model and recipe, each axis spelled out
    (a peer of another recipe refuses, naming the axes that differ)."""

    model_digest: str
    recipe_digest: str
    recipe_axes: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PeerCapability:
    """What a peer says it serves (GetCapability), as a route checks it against its report."""

    fingerprint: Fingerprint
    start: int
    end: int


@dataclass(frozen=True)
class LinkOrder:
    """Where a ring hop sends its output (docs/ring.md): the next hop, named by its signed report."""

    route_epoch: int
    peer_id: str
    next_report: bytes
    session_id: str
    attach_token: bytes
    forward_until: int
    stop_at_eog: bool


def recipe_fingerprint(model_digest: str, recipe_digest: str, recipe: Mapping[str, object]) -> Fingerprint:
    """A model and recipe with each axis spelled as text, as peers compare them."""
    return Fingerprint(model_digest, recipe_digest, {k: str(v) for k, v in recipe.items()})


def fingerprint_to_proto(fp: Fingerprint) -> pb.Fingerprint:
    return pb.Fingerprint(model_digest=fp.model_digest, recipe_digest=fp.recipe_digest,
                          recipe_axes=dict(fp.recipe_axes))


def fingerprint_from_proto(msg: pb.Fingerprint) -> Fingerprint:
    return Fingerprint(msg.model_digest, msg.recipe_digest, dict(msg.recipe_axes))


def sampling_to_proto(s: SamplingParams) -> pb.Sampling:
    return pb.Sampling(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed)


def sampling_from_proto(s: pb.Sampling) -> SamplingParams:
    """A session's sampling; an unset top_p (0) means none (1.0). Raises ValueError if out of range."""
    return SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p or 1.0, seed=s.seed)


def capability_from_proto(cap: pb.Capability) -> PeerCapability:
    return PeerCapability(fingerprint_from_proto(cap.fingerprint), cap.layers.start, cap.layers.end)


def link_to_proto(link: LinkOrder) -> pb.SessionRequest:
    return pb.SessionRequest(link=pb.LinkSignal(
        route_epoch=link.route_epoch, peer_id=link.peer_id, next_report=link.next_report,
        session_id=link.session_id, attach_token=link.attach_token, forward_until=link.forward_until,
        stop_at_eog=link.stop_at_eog))


def rollback_to_proto(position: int, route_epoch: int, attach_token: bytes) -> pb.SessionRequest:
    return pb.SessionRequest(rollback=pb.RollbackSignal(position=position, route_epoch=route_epoch,
                                                        attach_token=attach_token))


def attestation_from_proto(m: pb.Attestation) -> Attestation:
    return Attestation(m.peer_id, m.session_id, m.model_digest, m.recipe_digest, m.start, m.end, m.steps,
                       m.input_digest, m.output_digest, m.signature)


@dataclass(frozen=True)
class WireCommitment:
    """A step's commitment as it came over the wire, unverified: the fields a
    StepCommitment carries. ``complete`` adds what the receiver knows itself."""

    index: int
    input_digest: bytes
    output_digest: bytes
    signature: bytes
    prev: bytes = b""  # the rest: only in a forwarded one
    session_id: str = ""
    start: int = 0
    end: int = 0
    position: int = 0
    decode: bool = False

    def complete(self, *, peer_id: str, model_digest: str, recipe_digest: str, route_epoch: int,
                 **known) -> Commitment:
        """The Commitment this names, with ``known`` (session_id, start, end, position,
        decode, prev) overriding what the wire says; raises CommitmentError if malformed."""
        given = dict(index=self.index, input_digest=self.input_digest, output_digest=self.output_digest,
                     signature=self.signature, prev=self.prev, session_id=self.session_id, start=self.start,
                     end=self.end, position=self.position, decode=self.decode)
        given.update(known)
        return Commitment(peer_id=peer_id, model_digest=model_digest, recipe_digest=recipe_digest,
                          route_epoch=route_epoch, **given)

    def names(self, c: Commitment) -> bool:
        """Whether this carries ``c``'s index, digests and signature (what a client's copy holds)."""
        return (self.index, self.input_digest, self.output_digest, self.signature) == \
            (c.index, c.input_digest, c.output_digest, c.signature)


def commitment_from_proto(m: pb.StepCommitment) -> WireCommitment:
    return WireCommitment(m.index, m.input_digest, m.output_digest, m.signature, m.prev, m.session_id, m.start,
                          m.end, m.position, m.decode)
