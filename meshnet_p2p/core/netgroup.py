"""Which network an address belongs to, for every per-source bound.

Addresses cost an attacker something and identities cost nothing, so bounds
are kept per network: the DHT's diversity bound and store budgets, a relay's
circuits, a peer's fair shares. Two grains serve two purposes:
:func:`ip_group` (an IPv4 /24, an IPv6 /48: what one operator plausibly
holds) for the swarm-wide bounds, :func:`host_group` (one IPv4 address, an
IPv6 /64: one subscriber) for a peer's fair shares of its own capacity.
"""

from __future__ import annotations

import functools
import ipaddress

from .multiaddr import ip_of


@functools.lru_cache(maxsize=16384)  # asked for every member of a bucket a contact joins (as many as peer IDs interned)
def ip_group(host: str) -> str | None:
    """The network a public address belongs to, for the diversity bound; None
    for addresses it exempts (loopback, private, link-local, unparsable)."""
    ip = ip_of(host)
    if ip is None or not ip.is_global:
        return None
    return str(ipaddress.ip_network((ip, 24 if ip.version == 4 else 48), strict=False))


def network_of(host: str) -> str:
    """The network an address counts in for per-source bounds and for how many
    networks hold a value: its ip_group, or the exact address for those the
    diversity bound exempts (a private address counts alone)."""
    return ip_group(host) or host


def networks(contacts) -> int:
    """How many distinct networks (:func:`network_of`) ``contacts`` are in."""
    return len({network_of(c.host) for c in contacts})


def host_group(address: str) -> str:
    """The fairness group of a source address: IPv4 as is (also IPv4-mapped
    IPv6), IPv6 by /64, the usual size of one subscriber's network."""
    ip = ip_of(address)
    if ip is None:
        return address
    return str(ip) if ip.version == 4 else str(ipaddress.IPv6Network((ip, 64), strict=False))
