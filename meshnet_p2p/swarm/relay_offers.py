"""Relays found through the DHT: the signed record a relay announces, and how a
peer behind NAT ranks the relays it found (pure: no network here).

A relay (``meshnet-peer relay`` with bootstrap peers) signs a
``meshnet/relay/v1`` record under the key ``relays`` every
RELAY_ANNOUNCE_INTERVAL_S: its address, its limits and its load now. A peer
that cannot be dialled reads them, measures its own round trip to each, and
reserves on the best (:func:`rank_relays`). The load is the relay's own
claim, so it only breaks ties between relays a peer measured alike, and a
relay that refuses or fails is set aside by the peer whatever it claims.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from meshnet_p2p import __version__
from meshnet_p2p.core.netgroup import ip_group
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.core.multiaddr import Multiaddr, MultiaddrError, ip_of
from meshnet_p2p.core.records import PayloadType, sign_record, never_raising

RELAY = "meshnet/relay/v1"
RELAYS_KEY = "relays"
RELAY_TTL_MS = 120_000
RELAY_ANNOUNCE_INTERVAL_S = 30.0
MAX_RELAY_LIFETIME_MS = 10 * 60_000
MAX_COUNT = 1 << 40
_LIMITS = ("max_reservations", "max_connections_per_peer", "bytes_per_second_per_peer")
_LOAD = ("reservations_now", "circuits_now", "reservations", "refused", "spliced", "bytes", "expired")


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_COUNT


def relay_addr_problem(text: Any, peer_id: str | None = None) -> str | None:
    """Why ``text`` is not a relay's address (``/ip4|ip6|dns4/HOST/tcp/PORT/p2p/ID``), or None."""
    if not isinstance(text, str):
        return "is not a string"
    try:
        addr = Multiaddr.parse(text)
    except (MultiaddrError, ValueError):
        return "is not a multiaddr"
    protos = [p for p, _ in addr.components]
    if addr.transport != "tcp" or addr.host is None or not addr.port or "p2p-circuit" in protos or protos.count("p2p") != 1:
        return "must be a tcp address with host, port and one /p2p"
    if peer_id is not None and str(addr.peer_id) != peer_id:
        return "names another peer"
    return None


def _why(c: Mapping[str, Any]) -> str | None:
    if not isinstance(c, Mapping):
        return "content is not a map"
    for name in ("key", "peer_id", "addr", "limits", "load", "version"):
        if name not in c:
            return f"missing field {name}"
    if c["key"] != RELAYS_KEY:
        return f"key must be {RELAYS_KEY}"
    if not (isinstance(c["peer_id"], str) and 0 < len(c["peer_id"]) <= 128):
        return "peer_id must be a peer ID string"
    why = relay_addr_problem(c["addr"], c["peer_id"])
    if why:
        return f"addr {why}"
    limits, load = c["limits"], c["load"]
    if not (isinstance(limits, Mapping) and set(limits) == set(_LIMITS) and all(_count(limits[k]) for k in _LIMITS)):
        return f"limits must hold exactly {', '.join(_LIMITS)}, each a count"
    if not (isinstance(load, Mapping) and set(load) == set(_LOAD) and all(_count(load[k]) for k in _LOAD)):
        return f"load must hold exactly {', '.join(_LOAD)}, each a count"
    if not (isinstance(c["version"], str) and len(c["version"]) <= 32):
        return "version must be a short string"
    return None


# Why a relay record's content is malformed, or None.
valid_relay_content = never_raising(_why)


RELAY_TYPE = PayloadType(RELAY, max_payload_bytes=1024, replay_key_field="key", validate=valid_relay_content,
                         max_lifetime_ms=MAX_RELAY_LIFETIME_MS)
TYPES = {RELAY: RELAY_TYPE}


def sign_relay_record(identity: Identity, addr: Multiaddr, limits: Mapping[str, int], load: Mapping[str, int], *,
                      now_ms: int, ttl_ms: int = RELAY_TTL_MS) -> bytes:
    content = {"key": RELAYS_KEY, "peer_id": str(identity.peer_id), "addr": str(addr),
               "limits": {k: int(limits[k]) for k in _LIMITS},
               "load": {k: min(MAX_COUNT, int(load.get(k, 0))) for k in _LOAD}, "version": __version__}
    return sign_record(identity, RELAY, content, seq=now_ms, now_ms=now_ms, ttl_ms=ttl_ms)


@dataclass(frozen=True)
class RelayOffer:
    """A relay as a peer sees it: what its record says, and what the peer measured."""

    peer_id: str
    addr: str
    max_reservations: int
    reservations_now: int
    rtt_ms: float | None = None  # the peer's own measure; None: not reachable from here

    @classmethod
    def from_record(cls, content: Mapping[str, Any], rtt_ms: float | None = None) -> "RelayOffer":
        return cls(content["peer_id"], content["addr"], content["limits"]["max_reservations"],
                   content["load"]["reservations_now"], rtt_ms)

    @property
    def full(self) -> bool:
        return self.reservations_now >= self.max_reservations


LOAD_PENALTY_MS = 20.0  # a relay that says it is full costs this much more than an idle one, measured alike


def relay_score(offer: RelayOffer) -> float:
    """Lower is better: the round trip this peer measured, plus a penalty that grows
    with the load the relay claims (a claim only: it can tip close calls, no more)."""
    if offer.rtt_ms is None or not math.isfinite(offer.rtt_ms) or offer.rtt_ms < 0:
        return math.inf
    load = min(1.0, offer.reservations_now / max(1, offer.max_reservations))
    return offer.rtt_ms + LOAD_PENALTY_MS * load


def usable_host(host: str | None, *, allow_loopback: bool = False) -> bool:
    """Whether a relay record's host is worth dialling from here: never an
    unspecified or link-local address (a record costs nothing and could aim a
    peer's connects at its own machine), loopback only for a peer on loopback."""
    ip = ip_of(host or "")
    if ip is None:
        return host is not None  # a DNS name: dialled like any address
    if ip.is_unspecified or ip.is_link_local or ip.is_multicast:
        return False
    return allow_loopback or not ip.is_loopback


def one_per_network(contents: Iterable[Mapping[str, Any]], rng) -> list[Mapping[str, Any]]:
    """At most one relay record per public network (IPv4 /24, IPv6 /48), chosen at
    random, then shuffled: one host minting identities counts once. Private and
    loopback addresses are exempt (a LAN or a test swarm), as in the DHT's table."""
    groups: dict[str, list] = {}
    out = []
    for c in contents:
        group = ip_group(Multiaddr.parse(c["addr"]).host or "")
        if group is None:
            out.append(c)
        else:
            groups.setdefault(group, []).append(c)
    out += [rng.choice(members) for members in groups.values()]
    rng.shuffle(out)
    return out


def rank_relays(offers: Iterable[RelayOffer], *, me: str | None = None, avoid: Iterable[str] = ()) -> list[RelayOffer]:
    """The relays worth trying, best first: reachable, not this peer, not full, by
    :func:`relay_score`; those set aside (``avoid``: they failed lately) come
    after every other, so a peer whose only relay blinked tries it again."""
    skip = set(avoid)
    usable = [o for o in offers if o.peer_id != me and not o.full and math.isfinite(relay_score(o))]
    return sorted(usable, key=lambda o: (o.peer_id in skip, relay_score(o), o.peer_id))


def circuit_addr(relay: Multiaddr | str, peer_id: Any) -> str:
    """``<relay>/p2p-circuit/p2p/<peer>``: a peer reached through a relay, as libp2p writes it."""
    return f"{relay}/p2p-circuit/p2p/{peer_id}"
