"""Signed records: the one envelope for everything that crosses the network.

Wire form (msgpack array)::

    [payload_type, payload, seq, issued_at_ms, expires_at_ms, signer, signature]

``payload`` is the canonical msgpack encoding of the record's content (maps
with sorted keys, no extension types); ``signer`` is the signer's peer ID
bytes, which carry its Ed25519 key; the signature covers a domain tag and the
first six fields. A record is accepted only if every check passes; each
rejection has a reason (:class:`Reject`), so a caller can count and log them.

The verifier is pure: the clock, the known payload types and the replay state
are data passed in, so every reason is tested without a network or a clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Iterable, Mapping

import msgpack

from .errors import MeshnetError
from .identity import Identity, IdentityError, PeerId

DOMAIN = b"meshnet-record-v1\0"
MAX_RECORD_BYTES = 16 * 1024  # a capability report is well under 2 KB
MAX_CLOCK_SKEW_MS = 30_000
MAX_LIFETIME_MS = 24 * 3600 * 1000


def wall_ms() -> int:
    """Unix time in milliseconds: the clock of record timestamps and step deadlines."""
    return int(time.time() * 1000)


def keep_newest(found: dict[bytes, "Record"], records: Iterable["Record"]) -> dict[bytes, "Record"]:
    """Merge ``records`` into ``found`` (signer -> record), keeping each signer's highest seq."""
    for rec in records:
        old = found.get(rec.signer.multihash)
        if old is None or rec.seq > old.seq:
            found[rec.signer.multihash] = rec
    return found


class Reject(str, Enum):
    OVERSIZED = "oversized"
    MALFORMED = "malformed"
    UNKNOWN_TYPE = "unknown-type"
    BAD_SIGNATURE = "bad-signature"
    SIGNER_MISMATCH = "signer-mismatch"
    EXPIRED = "expired"
    FROM_FUTURE = "from-future"
    REPLAYED = "replayed"


class RecordRejected(MeshnetError):
    def __init__(self, reason: Reject, detail: str) -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"record rejected ({reason.value}): {detail}")


def never_raising(why: Callable[[Mapping[str, Any]], str | None]) -> Callable[[Mapping[str, Any]], str | None]:
    """A content check (``why``: a short reason naming the field, or None) that never
    raises whatever a signer put in the content: a type no check foresaw is a reason
    too, never an escape. Every payload type's ``validate`` is one of these."""
    def valid(content: Mapping[str, Any]) -> str | None:
        try:
            return why(content)
        except Exception as e:
            return f"unreadable content ({type(e).__name__})"
    valid.__doc__ = why.__doc__
    return valid


@dataclass(frozen=True)
class PayloadType:
    """A kind of record: its name, size bound, and the payload field (if any)
    that claims a peer identity, which must equal the signer."""

    name: str
    max_payload_bytes: int = 8 * 1024
    claimed_peer_field: str | None = "peer_id"
    replay_key_field: str | None = None  # records of one signer are ordered per this field's value
    validate: Callable[[Mapping[str, Any]], str | None] | None = None  # why content is malformed, or None
    max_lifetime_ms: int | None = None  # the longest this kind may live (default: the verifier's bound)
    # fields that change from one record of a signer to its next (load figures): a record that
    # differs from the one held only in these is a refresh, which gossip keeps but does not push
    volatile_fields: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Record:
    payload_type: str
    content: Mapping[str, Any]
    seq: int
    issued_at_ms: int
    expires_at_ms: int
    signer: PeerId
    signature: bytes
    wire: bytes


def canonical(obj: Any) -> bytes:
    """Canonical msgpack: map keys sorted, binary as bin, no floats NaN games."""
    return msgpack.packb(_sorted(obj), use_bin_type=True)


def _sorted(obj: Any) -> Any:
    # The common types first, by exact type: isinstance against typing's Mapping goes
    # through its generic alias and the ABC machinery (~7 % of a simulated 10,000-peer
    # swarm's time went to checking that gossiped payloads are canonical)
    t = type(obj)
    if t is str or t is int or t is bytes or t is bool or t is float or obj is None:
        return obj
    if t is dict or isinstance(obj, Mapping):
        if not all(isinstance(k, str) for k in obj):
            raise TypeError("record maps must have string keys")
        return {k: _sorted(obj[k]) for k in sorted(obj)}
    if isinstance(obj, (list, tuple)):
        return [_sorted(x) for x in obj]
    return obj


def unpack_strict(data: bytes) -> Any:
    """msgpack from the network. unpackb bounds every string/array/map length by
    the input's size (callers size-check the input first); extension types are
    refused outright."""
    return msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True, max_ext_len=0)


# Records and DHT datagrams share one signed form: a msgpack array whose last
# element is the Ed25519 signature, over a domain tag and the array before it.


# A head of fewer than 15 elements packs as a fixarray (one byte, 0x90 | length): the
# sealed form is then that byte for one more element, the head's element bytes as they
# are, and the signature as bin8 (0xc4 0x40 and its 64 bytes). Sealing and checking
# reuse those bytes instead of packing the head a second time (every DHT datagram is
# sealed: ~3 % of a simulated swarm's time went to the second packing).
_SIG_BIN8 = b"\xc4\x40"


def seal(identity: Identity, domain: bytes, head: list[Any]) -> bytes:
    packed = msgpack.packb(head, use_bin_type=True)
    signature = identity.sign(domain + packed)
    if len(head) < 15 and len(signature) == 64:
        return bytes([0x90 | (len(head) + 1)]) + packed[1:] + _SIG_BIN8 + signature
    return msgpack.packb(head + [signature], use_bin_type=True)


def head_verifies(signer: PeerId, signature: bytes, domain: bytes, head: list[Any], *,
                  sealed: bytes | None = None) -> bool:
    """Does ``signature`` verify ``head`` for ``signer``? With ``sealed``, the bytes
    ``head`` and ``signature`` were unpacked from (head + [signature]), the head's
    bytes are read off them when laid out as :func:`seal` lays them (a signer's
    own packing of the same values is then what is checked), else packed again."""
    n = len(head)
    if (sealed is not None and n < 15 and len(signature) == 64 and len(sealed) > 66
            and sealed[0] == 0x90 | (n + 1) and sealed[-66:-64] == _SIG_BIN8 and sealed[-64:] == signature):
        return signer.verify(signature, domain + bytes([0x90 | n]) + sealed[1:-66])
    return signer.verify(signature, domain + msgpack.packb(head, use_bin_type=True))


def sign_record(
    identity: Identity,
    payload_type: str,
    content: Mapping[str, Any],
    *,
    seq: int,
    now_ms: int,
    ttl_ms: int,
) -> bytes:
    head = [payload_type, canonical(content), seq, now_ms, now_ms + ttl_ms, identity.peer_id.multihash]
    return seal(identity, DOMAIN, head)


def peek(wire: bytes) -> tuple[bytes, int, Any] | None:
    """(signer bytes, seq, content key) of an envelope, unverified, or None.

    Lets a node drop a record it already has before paying for a signature
    check: gossip delivers each record from several neighbours."""
    got = peek_unpacked(wire)
    return None if got is None else got[0]


def peek_unpacked(wire: bytes) -> tuple[tuple[bytes, int, Any], list, Any] | None:
    """:func:`peek`'s answer, and what it unpacked (the envelope's fields, the
    content), for :meth:`RecordVerifier.verify` to check without unpacking again."""
    if len(wire) > MAX_RECORD_BYTES:
        return None
    try:
        fields = unpack_strict(wire)
        if not (isinstance(fields, list) and len(fields) == 7 and isinstance(fields[1], bytes)):
            return None
        content = unpack_strict(fields[1])
        return (fields[5], fields[2], content.get("key") if isinstance(content, dict) else None), fields, content
    except Exception:
        return None


@dataclass
class RecordVerifier:
    """Verifies envelopes against known types, a clock, and the sequence numbers
    seen so far (per signer, type and replay key)."""

    types: Mapping[str, PayloadType]
    max_clock_skew_ms: int = MAX_CLOCK_SKEW_MS
    max_lifetime_ms: int = MAX_LIFETIME_MS
    last_seq: dict[tuple[bytes, str, Any], int] = field(default_factory=dict)

    def verify(self, wire: bytes, now_ms: int, *, remember: bool = True,
               unpacked: tuple[list, Any] | None = None) -> Record:
        """``unpacked``: what :func:`peek_unpacked` unpacked of ``wire`` (its
        fields and content), checked here as if unpacked here."""
        return self._admit(self.checked(wire, unpacked), now_ms, remember)

    def checked(self, wire: bytes, unpacked: tuple[list, Any] | None = None) -> Record:
        """Every check of ``wire`` that holds or fails whatever the clock and the
        sequence numbers seen (form, type, size, signature, encoding, content,
        claimed peer): a pure function of ``wire`` and this verifier's types.
        :meth:`verify` adds the checks of time and replay."""
        if len(wire) > MAX_RECORD_BYTES:
            raise RecordRejected(Reject.OVERSIZED, f"{len(wire)} bytes > {MAX_RECORD_BYTES}")
        if unpacked is not None:
            fields = unpacked[0]  # read, never changed here
        else:
            try:
                fields = unpack_strict(wire)
            except Exception as e:  # msgpack raises many types for bad input
                raise RecordRejected(Reject.MALFORMED, f"not msgpack: {type(e).__name__}") from None
        if not (isinstance(fields, list) and len(fields) == 7):
            raise RecordRejected(Reject.MALFORMED, "envelope is not a 7-element array")
        ptype, payload, seq, issued, expires, signer_bytes, signature = fields
        if not (
            isinstance(ptype, str)
            and isinstance(payload, bytes)
            and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**63 for x in (seq, issued, expires))
            and isinstance(signer_bytes, bytes)
            and isinstance(signature, bytes)
            and len(signature) == 64
        ):
            raise RecordRejected(Reject.MALFORMED, "envelope fields have the wrong types")
        kind = self.types.get(ptype)
        if kind is None:
            raise RecordRejected(Reject.UNKNOWN_TYPE, f"payload type {ptype[:64]!r} is not known here")
        if len(payload) > kind.max_payload_bytes:
            raise RecordRejected(Reject.OVERSIZED, f"{ptype} payload of {len(payload)} bytes > {kind.max_payload_bytes}")
        try:
            signer = PeerId.from_bytes(signer_bytes)
        except IdentityError as e:
            raise RecordRejected(Reject.MALFORMED, f"signer: {e}") from None
        if not head_verifies(signer, signature, DOMAIN, fields[:6], sealed=wire):
            raise RecordRejected(Reject.BAD_SIGNATURE, f"signature does not verify for {signer}")
        try:
            content = unpack_strict(payload) if unpacked is None else unpacked[1]
        except Exception as e:
            raise RecordRejected(Reject.MALFORMED, f"payload is not msgpack: {type(e).__name__}") from None
        if not isinstance(content, dict):
            raise RecordRejected(Reject.MALFORMED, "payload is not a map")
        try:
            if canonical(content) != payload:
                raise RecordRejected(Reject.MALFORMED, "payload is not canonically encoded")
        except TypeError as e:
            raise RecordRejected(Reject.MALFORMED, str(e)) from None
        if kind.validate is not None:
            why = kind.validate(content)
            if why is not None:
                err = RecordRejected(Reject.MALFORMED, f"{ptype} content: {why}")
                err.content_reason = why.split(":")[0][:64]  # a fixed set: countable per reason
                raise err
        if kind.claimed_peer_field is not None:
            claimed = content.get(kind.claimed_peer_field)
            if claimed != str(signer):
                raise RecordRejected(
                    Reject.SIGNER_MISMATCH, f"record claims peer {str(claimed)[:60]!r} but is signed by {signer}"
                )
        return Record(ptype, content, seq, issued, expires, signer, signature, wire)

    def _admit(self, record: Record, now_ms: int, remember: bool) -> Record:
        """The checks of a :meth:`checked` record against the clock and the sequence
        numbers seen (noting its own if ``remember``)."""
        ptype, seq, issued, expires, signer = record.payload_type, record.seq, record.issued_at_ms, \
            record.expires_at_ms, record.signer
        kind = self.types[ptype]
        if issued > now_ms + self.max_clock_skew_ms:
            raise RecordRejected(Reject.FROM_FUTURE, f"issued {issued - now_ms} ms in the future")
        if expires <= now_ms:
            raise RecordRejected(Reject.EXPIRED, f"expired {now_ms - expires} ms ago")
        if expires < issued or expires - issued > self.max_lifetime_ms:
            raise RecordRejected(Reject.MALFORMED, "lifetime is negative or longer than allowed")
        if kind.max_lifetime_ms is not None and expires - issued > kind.max_lifetime_ms:
            raise RecordRejected(Reject.MALFORMED, f"a {ptype} lives at most {kind.max_lifetime_ms // 1000} s")
        replay_key = (signer.multihash, ptype,
                      record.content.get(kind.replay_key_field) if kind.replay_key_field else None)
        try:
            hash(replay_key)
        except TypeError:
            raise RecordRejected(Reject.MALFORMED, "replay key field is not a scalar") from None
        last = self.last_seq.get(replay_key)
        if last is not None and seq <= last:
            raise RecordRejected(Reject.REPLAYED, f"sequence {seq} is not newer than {last} already seen")
        if remember:
            self.last_seq[replay_key] = seq
        return record
