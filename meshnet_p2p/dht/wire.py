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

# the DHT's own kinds; a role serves more (DHTNode.serve_requests, e.g. nat/dialer.py's dial_back),
# whose answers are known by their rpc id: so any short kind name decodes, the node drops unknown ones
REQUESTS = {"ping", "find_node", "find_value", "store", "gossip_push", "gossip_pull"}
RESPONSES = {"pong", "nodes", "values", "stored", "gossip_ack", "gossip_records",
             "cookie"}  # "prove you receive at this address: ask again with this cookie"
KINDS = REQUESTS | RESPONSES
MAX_KIND_CHARS = 32


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
    if not isinstance(kind, str) or not 0 < len(kind) <= MAX_KIND_CHARS:  # unverified: may be anything
        raise BadDatagram(f"bad kind {str(kind)[:32]!r}")
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
    if not head_verifies(peer, signature, DOMAIN, fields[:7], sealed=data):
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
