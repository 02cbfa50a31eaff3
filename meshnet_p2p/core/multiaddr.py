"""Multiaddrs in libp2p's text form, e.g. ``/ip4/127.0.0.1/udp/4001/p2p/12D3KooW...``.

Parsing is strict and bounded: every component is validated (addresses by
``ipaddress``, ports 0..65535, DNS names by RFC 1123 rules, peer IDs by
:mod:`meshnet_p2p.core.identity`), so a multiaddr that parses can be dialled
without further checks.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from dataclasses import dataclass

from .errors import MeshnetError
from .identity import IdentityError, PeerId

MAX_MULTIADDR_CHARS = 512
_HOSTNAME = re.compile(r"(?=.{1,253}\Z)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?\Z",
                       re.ASCII)  # \Z, not $: "$" also matches before a final newline
_WITH_VALUE = {"ip4", "ip6", "dns", "dns4", "dns6", "tcp", "udp", "p2p"}
_FLAGS = {"p2p-circuit"}


class MultiaddrError(MeshnetError):
    pass


@dataclass(frozen=True)
class Multiaddr:
    components: tuple[tuple[str, str], ...]

    @classmethod
    def for_socket(cls, host: str, transport: str, port: int, peer_id: PeerId) -> "Multiaddr":
        """The address of a socket this peer bound, e.g. ``/ip4/127.0.0.1/tcp/PORT/p2p/ID``."""
        return cls.parse(f"/{'ip6' if ':' in host else 'ip4'}/{host}/{transport}/{port}/p2p/{peer_id}")

    @classmethod
    def parse(cls, text: str) -> "Multiaddr":
        if not isinstance(text, str) or not text.startswith("/"):
            raise MultiaddrError(f"{text!r} is not a multiaddr (it must start with '/')")
        if len(text) > MAX_MULTIADDR_CHARS:
            raise MultiaddrError("multiaddr is too long")
        return _parse(text)

    @classmethod
    def _parse_uncached(cls, text: str) -> "Multiaddr":
        parts = text.strip("/").split("/")
        comps: list[tuple[str, str]] = []
        i = 0
        while i < len(parts):
            proto = parts[i]
            if proto in _FLAGS:
                comps.append((proto, ""))
                i += 1
                continue
            if proto not in _WITH_VALUE:
                raise MultiaddrError(f"{text!r}: unsupported protocol {proto!r}")
            if i + 1 >= len(parts) or parts[i + 1] == "":
                raise MultiaddrError(f"{text!r}: /{proto} needs a value")
            comps.append((proto, _check(proto, parts[i + 1], text)))
            i += 2
        addr = cls(tuple(comps))
        addr._check_shape(text)
        return addr

    def _check_shape(self, text: str) -> None:
        protos = [p for p, _ in self.components]
        if not protos:
            raise MultiaddrError(f"{text!r} is empty")
        if sum(p in ("tcp", "udp") for p in protos) > 1 and "p2p-circuit" not in protos:
            raise MultiaddrError(f"{text!r} has more than one transport")
        if protos.count("p2p") > 2:
            raise MultiaddrError(f"{text!r} has too many /p2p components")

    def __str__(self) -> str:
        return "".join(f"/{p}" + (f"/{v}" if v else "") for p, v in self.components)

    @property
    def host(self) -> str | None:
        for p, v in self.components:
            if p in ("ip4", "ip6", "dns", "dns4", "dns6"):
                return v
        return None

    @property
    def port(self) -> int | None:
        for p, v in self.components:
            if p in ("tcp", "udp"):
                return int(v)
        return None

    @property
    def transport(self) -> str | None:
        for p, _ in self.components:
            if p in ("tcp", "udp"):
                return p
        return None

    @functools.cached_property  # a parse is shared (``_parse``): its peer ID is decoded once, not per report checked
    def peer_id(self) -> PeerId | None:
        """The last /p2p component: the peer this address reaches (after a relay, the target)."""
        found = None
        for p, v in self.components:
            if p == "p2p":
                found = v
        return PeerId.from_string(found) if found else None


def announced(text: str, peer_id: PeerId) -> Multiaddr:
    """An ``--announce`` address: where others reach this peer's TCP port when
    that is not where it listens (port forwarding, a proxy, a delaying
    forwarder), as libp2p's announce addresses. A host and a non-zero tcp port;
    ``/p2p/`` is added if absent and must be this peer's if present."""
    addr = Multiaddr.parse(text)
    protos = [p for p, _ in addr.components]
    if addr.host is None or addr.transport != "tcp" or not addr.port or "p2p-circuit" in protos:
        raise MultiaddrError(f"{text!r}: an announce address is a host and a tcp port other than 0, "
                             "e.g. /ip4/203.0.113.7/tcp/4100")
    if addr.peer_id is None:
        return Multiaddr(addr.components + (("p2p", str(peer_id)),))
    if protos.count("p2p") != 1 or addr.peer_id != peer_id:
        raise MultiaddrError(f"{text!r} names another peer than this one ({peer_id})")
    return addr


def _check(proto: str, value: str, text: str) -> str:
    try:
        if proto == "ip4":
            return str(ipaddress.IPv4Address(value))
        if proto == "ip6":
            if "%" in value:  # a scope ID means nothing beyond this host, and ipaddress accepts any text in it
                raise ValueError("an ip6 address with a scope ID")
            return str(ipaddress.IPv6Address(value))
        if proto in ("tcp", "udp"):
            if not (value.isascii() and value.isdigit()) or not 0 <= int(value) <= 65535 or (len(value) > 1 and value[0] == "0"):
                raise MultiaddrError(f"{text!r}: port {value!r} is not 0..65535")
            return value
        if proto in ("dns", "dns4", "dns6"):
            if not _HOSTNAME.match(value):
                raise MultiaddrError(f"{text!r}: {value!r} is not a valid DNS name")
            return value
        if proto == "p2p":
            return str(PeerId.from_string(value))
    except (ValueError, IdentityError) as e:
        raise MultiaddrError(f"{text!r}: bad /{proto} value {value!r}: {e}") from None
    raise MultiaddrError(f"{text!r}: unsupported protocol {proto!r}")


def ip_of(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address a host string names, IPv4-mapped IPv6 as IPv4 and a scope
    ID ignored; None if it is no IP address."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


@functools.lru_cache(maxsize=16384)
def _parse(text: str) -> Multiaddr:
    """Parsed once per text (frozen, so shared): every capability report a DHT node
    verifies names the same few addresses again, and parsing one is ~0.1 ms. (As many
    as the peer IDs interned: a simulated swarm's nodes share one process, and at
    4,096 its 10,000 peers' addresses were parsed again and again.)"""
    return Multiaddr._parse_uncached(text)
