"""Where a socket bound to a wildcard can be dialled: one address per local
address, loopback last, as libp2p prints them.

``0.0.0.0`` and ``::`` are no address anyone can dial (a bootstrap peer printed
as ``/ip4/0.0.0.0/...`` sends joiners nowhere), so a role listening on every
address prints each of them instead. The standard library cannot list a
machine's interface addresses portably (``socket.if_nameindex`` gives names
only, ``getaddrinfo(gethostname())`` what the resolver says, often just
127.0.1.1), so psutil's ``net_if_addrs`` (getifaddrs on Linux and macOS, the IP
helper API on Windows; well kept, wheels everywhere) lists them, and
``net_if_stats`` says which interfaces are up.
"""

from __future__ import annotations

import ipaddress
from typing import Iterable

from .identity import PeerId
from .multiaddr import Multiaddr

WILDCARDS = frozenset({"0.0.0.0", "::", ""})


def is_wildcard(host: str) -> bool:
    return host in WILDCARDS


def order_hosts(wildcard: str, found: Iterable[str]) -> list[str]:
    """The addresses among ``found`` that a socket bound to ``wildcard`` answers
    at: its family only, each once, loopback last. IPv6 link-local addresses are
    left out (dialling one needs an interface zone a multiaddr cannot carry), and
    so is anything that is not an IP address. With none found: loopback alone."""
    want = 6 if ":" in wildcard else 4
    seen: dict[str, ipaddress.IPv4Address | ipaddress.IPv6Address] = {}
    for text in found:
        try:
            ip = ipaddress.ip_address(text.split("%", 1)[0])
        except ValueError:
            continue
        if ip.version != want or ip.is_unspecified or (ip.version == 6 and ip.is_link_local):
            continue
        seen.setdefault(str(ip), ip)
    hosts = [h for h, ip in seen.items() if not ip.is_loopback] + [h for h, ip in seen.items() if ip.is_loopback]
    return hosts or (["::1"] if want == 6 else ["127.0.0.1"])


def interface_hosts() -> list[str]:
    """Every address of every interface that is up, in the order the system lists them."""
    import psutil

    up = {name for name, st in psutil.net_if_stats().items() if st.isup}
    return [a.address for name, addrs in psutil.net_if_addrs().items() if name in up for a in addrs]


def listen_hosts(host: str, found: Iterable[str] | None = None) -> list[str]:
    """``[host]``, or for a wildcard every local address of its family, loopback last
    (``found``: the local addresses, by default the interfaces')."""
    if not is_wildcard(host):
        return [host]
    return order_hosts(host, interface_hosts() if found is None else found)


def listen_multiaddrs(host: str, transport: str, port: int, peer_id: PeerId,
                      found: Iterable[str] | None = None) -> list[Multiaddr]:
    """The multiaddrs of a socket bound to ``host``:``port``, one per address it answers at."""
    return [Multiaddr.for_socket(h, transport, port, peer_id) for h in listen_hosts(host, found)]


def listen_urls(host: str, bound: str, found: Iterable[str] | None = None) -> list[str]:
    """The URLs of an HTTP server asked to listen on ``host`` that says it is bound
    at ``bound`` (e.g. ``http://0.0.0.0:8000``): that one, or one per local address."""
    if not is_wildcard(host):
        return [bound]
    scheme, _, rest = bound.partition("://")
    port = int(rest.rstrip("/").rsplit(":", 1)[1])
    return [f"{scheme}://[{h}]:{port}" if ":" in h else f"{scheme}://{h}:{port}" for h in listen_hosts(host, found)]
