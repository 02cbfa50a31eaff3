"""DHT datagrams: every one signed by its sender, parsed strictly and bounded.

Wire form (msgpack array)::

    ["mdht2", kind, rpc_id, sender, to, sent_ms, body, signature]

``sender`` is the sender's peer ID bytes (which carry its key); ``to`` the
recipient's (empty only when the sender does not know it yet: a first ping to
an address); the signature covers a domain tag and the fields before it. A
datagram addressed to another node is dropped, so one cannot be replayed to a
node it was not meant for. A datagram whose signature does
not verify, whose clock is far off, or whose body is not of its kind's shape
is dropped with a reason (:class:`BadDatagram`), before any state changes.
Node IDs are derived from the verified key, so nobody can claim a position
in the ID space they do not hold the key for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.core.identity import Identity, IdentityError, PeerId
from meshnet_p2p.core.records import head_verifies, seal, unpack_strict

VERSION = "mdht2"
DOMAIN = b"meshnet-dht-v1\0"
MAX_DATAGRAM = 60_000
MAX_CLOCK_SKEW_MS = 60_000

REQUESTS = {"ping", "find_node", "find_value", "store", "gossip_push", "gossip_pull",
            "dial_back"}  # "dial these addresses of mine back and tell me (signed) what answered"
RESPONSES = {"pong", "nodes", "values", "stored", "gossip_ack", "gossip_records",
             "dial_result",  # {"result": a signed meshnet/dialback/v1 record} or {"refused": why}
             "cookie"}  # "prove you receive at this address: ask again with this cookie"
KINDS = REQUESTS | RESPONSES


class BadDatagram(MeshnetError):
    pass


@dataclass(frozen=True)
class Message:
    kind: str
    rpc_id: bytes
    sender: PeerId
    sent_ms: int
    body: dict[str, Any]


def new_rpc_id() -> bytes:
    return os.urandom(8)


def encode(identity: Identity, kind: str, rpc_id: bytes, body: dict[str, Any], now_ms: int,
           to: PeerId | None = None) -> bytes:
    recipient = to.multihash if to is not None else b""
    data = seal(identity, DOMAIN, [VERSION, kind, rpc_id, identity.peer_id.multihash, recipient, now_ms, body])
    if len(data) > MAX_DATAGRAM:
        raise ValueError(f"{kind} datagram of {len(data)} bytes exceeds {MAX_DATAGRAM}")
    return data


def decode(data: bytes, now_ms: int, me: PeerId | None = None) -> Message:
    if len(data) > MAX_DATAGRAM:
        raise BadDatagram("oversized datagram")
    try:
        fields = unpack_strict(data)
    except Exception as e:
        raise BadDatagram(f"not msgpack: {type(e).__name__}") from None
    if not (isinstance(fields, list) and len(fields) == 8):
        raise BadDatagram("not an 8-element datagram")
    version, kind, rpc_id, sender, to, sent_ms, body, signature = fields
    if version != VERSION:
        raise BadDatagram(f"unknown version {str(version)[:16]!r}")
    if not isinstance(kind, str) or kind not in KINDS:  # unverified: a list here must not raise TypeError
        raise BadDatagram(f"unknown kind {str(kind)[:32]!r}")
    if not (isinstance(rpc_id, bytes) and len(rpc_id) == 8):
        raise BadDatagram("bad rpc id")
    if not (isinstance(sent_ms, int) and not isinstance(sent_ms, bool)) or abs(sent_ms - now_ms) > MAX_CLOCK_SKEW_MS:
        raise BadDatagram("sender clock is too far off (or bad timestamp)")
    if not isinstance(body, dict) or not (isinstance(signature, bytes) and len(signature) == 64) \
            or not isinstance(sender, bytes) or not isinstance(to, bytes):
        raise BadDatagram("malformed fields")
    if to and me is not None and to != me.multihash:
        raise BadDatagram("addressed to another node")
    try:
        peer = PeerId.from_bytes(sender)
    except IdentityError as e:
        raise BadDatagram(f"bad sender: {e}") from None
    if not head_verifies(peer, signature, DOMAIN, fields[:7]):
        raise BadDatagram(f"signature does not verify for {peer}")
    return Message(kind, rpc_id, peer, sent_ms, body)


# --- body helpers: strict field access ----------------------------------------


def field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], *, max_len: int | None = None) -> Any:
    value = body.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise BadDatagram(f"field {name!r} missing or of the wrong type")
    if max_len is not None and len(value) > max_len:
        raise BadDatagram(f"field {name!r} is too long")
    return value


def encode_contacts(contacts) -> list[list[Any]]:
    return [[c.peer_id.multihash, c.host, c.port] for c in contacts]


def decode_contacts(raw: Any, limit: int) -> list[tuple[PeerId, str, int]]:
    if not isinstance(raw, list) or len(raw) > limit:
        raise BadDatagram("bad contact list")
    out = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 3):
            raise BadDatagram("bad contact")
        pid, host, port = item
        if not (isinstance(pid, bytes) and isinstance(host, str) and len(host) <= 255 and isinstance(port, int) and 0 < port < 65536):
            raise BadDatagram("bad contact fields")
        try:
            out.append((PeerId.from_bytes(pid), host, port))
        except IdentityError:
            raise BadDatagram("bad contact peer id") from None
    return out


# --- dial_back / dial_result bodies (reachability checks, meshnet_p2p/dialback.py) ---------------

MAX_DIAL_ADDRS = 4
MAX_DIAL_ADDR_CHARS = 512
DIAL_NONCE_BYTES = 16
MAX_DIAL_RESULT_BYTES = 4096  # the signed record in a dial_result (well under one datagram)
MAX_REFUSAL_CHARS = 64


def parse_dial_back(body: dict[str, Any]) -> tuple[list[str], bytes]:
    """A dial_back request's addresses (1 to 4 distinct strings of at most 512
    chars, not yet parsed as multiaddrs) and its 16-byte nonce; BadDatagram for
    anything else. Other keys (cookie, client) are the envelope's business."""
    addrs = body.get("addrs")
    if not isinstance(addrs, list) or not 1 <= len(addrs) <= MAX_DIAL_ADDRS:
        raise BadDatagram(f"addrs must be a list of 1 to {MAX_DIAL_ADDRS} multiaddrs")
    if not all(isinstance(a, str) and len(a) <= MAX_DIAL_ADDR_CHARS for a in addrs):
        raise BadDatagram(f"each of addrs must be a str of at most {MAX_DIAL_ADDR_CHARS} chars")
    if len(set(addrs)) != len(addrs):
        raise BadDatagram("addrs has duplicates")
    nonce = body.get("nonce")
    if not (isinstance(nonce, bytes) and len(nonce) == DIAL_NONCE_BYTES):
        raise BadDatagram(f"nonce must be {DIAL_NONCE_BYTES} bytes")
    return list(addrs), nonce


def parse_dial_result(body: dict[str, Any]) -> tuple[bytes | None, str | None]:
    """A dial_result's (signed record, None) or (None, refusal reason); exactly
    one of the two. The record is only bytes here: the asker verifies it."""
    result, refused = body.get("result"), body.get("refused")
    if (result is None) == (refused is None):
        raise BadDatagram("a dial_result carries exactly one of result and refused")
    if result is not None:
        if not (isinstance(result, bytes) and len(result) <= MAX_DIAL_RESULT_BYTES):
            raise BadDatagram(f"result must be a signed record of at most {MAX_DIAL_RESULT_BYTES} bytes")
        return result, None
    if not (isinstance(refused, str) and len(refused) <= MAX_REFUSAL_CHARS):
        raise BadDatagram(f"refused must be a str of at most {MAX_REFUSAL_CHARS} chars")
    return None, refused
