"""Tensor bundles on the wire: named tensors split into fragments, each tensor
checked for exact tiling and its CRC32C before anything uses its bytes; and
the typed values a client's calls take and return (fingerprint, sampling,
capability, ring link and rollback, attestation), converted here only."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import google_crc32c

from meshnet_p2p._proto import shard_runtime_pb2 as pb
from meshnet_p2p.engine.contract import SamplingParams, Tensor, TensorBundle
from meshnet_p2p.engine.seam import seam_itemsize
from meshnet_p2p.trust.certification import Attestation

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


def fingerprint_to_proto(fp: Fingerprint) -> pb.Fingerprint:
    return pb.Fingerprint(model_digest=fp.model_digest, recipe_digest=fp.recipe_digest,
                          recipe_axes=dict(fp.recipe_axes))


def fingerprint_from_proto(msg: pb.Fingerprint) -> Fingerprint:
    return Fingerprint(msg.model_digest, msg.recipe_digest, dict(msg.recipe_axes))


def sampling_to_proto(s: SamplingParams) -> pb.Sampling:
    return pb.Sampling(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed)


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
