"""The control plane's Python API: start a DHT node on a real socket, join
through bootstrap peers, publish and find capability reports.

    async with trio.open_nursery() as nursery:
        node = await start_node(nursery, identity, listen="127.0.0.1:0",
                                bootstrap=["/ip4/127.0.0.1/udp/4001/p2p/12D3KooW..."])
        await node.publish(model_key(digest), report.sign(identity, seq=1, now_ms=...))
        peers = await peers_for_model(node, digest)
"""

from __future__ import annotations

import os
import socket
import pathlib
from typing import Any, Callable, Iterable, Mapping

import trio

from . import capability
from .capability import model_key
from meshnet_p2p.trust import catalogue, verdicts
from meshnet_p2p.trust.evidence import CERT_INDEX, CERT_INDEX_TYPE, CERTIFICATE, CERTIFICATE_TYPE, model_of_key
from meshnet_p2p.dht.node import DHTConfig, DHTNode
from meshnet_p2p.dht.routing import Contact
from meshnet_p2p.dht.transport import UdpTransport
from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.core.local_addrs import is_wildcard, listen_multiaddrs
from meshnet_p2p.core.multiaddr import Multiaddr, MultiaddrError, ip_of
from meshnet_p2p.core.records import PayloadType, Record, keep_newest
from .relay_offers import TYPES as RELAY_TYPES

ENV_BOOTSTRAP = "MESHNET_BOOTSTRAP"
DEFAULT_LIST = pathlib.Path(__file__).resolve().parents[2] / "bootstrap" / "peers.txt"


# every record type a node accepts: capability reports, the model index, certificates, relays,
# fraud reports, certifiers' peer verdicts and their catalogues of model names
TYPES: dict[str, PayloadType] = {**capability.TYPES, CERTIFICATE: CERTIFICATE_TYPE, CERT_INDEX: CERT_INDEX_TYPE,
                                 **RELAY_TYPES, **verdicts.TYPES, **catalogue.TYPES}


class BootstrapError(MeshnetError):
    pass


UNANNOUNCED_LIFETIME_MS = 10 * 60_000  # twice the DHT's republish period: a certifier's re-put renews it


def lifetime_cap(key: str, holds: Callable[[str], bool]) -> int | None:
    """This node's storage policy for the DHT (dht.node.LifetimeCap): evidence, an
    index, a fraud report or verdicts naming a model nobody announces (no ``model/<digest>`` report the
    node holds from a peer it knows is live) lives minutes, not the day it
    claims, and goes first when a node needs room. Such keys cost a flood
    nothing to make up (issue 24 #3); a certified model is one peers serve."""
    model = model_of_key(key) or verdicts.model_of_key(key)
    if model is None or holds(model_key(model)):
        return None
    return UNANNOUNCED_LIFETIME_MS


# Fraud reports one source network may store under one accused peer's key on a node. The
# accused (or a framer) has a network or a few; honest reporters are many networks. So one
# operator cannot bury the reports against it under its own (issue 59, the shield): a home
# keeps the earliest it took and refuses that network's next ones.
REPORTS_PER_NETWORK = 4


def source_cap(key: str) -> int | None:
    """This node's bound on one source network's values of ``key`` (dht.node.SourceCap)."""
    return REPORTS_PER_NETWORK if verdicts.model_of_key(key) is not None and key.startswith("fraud/") else None


def parse_listen(text: str, flag: str = "--listen") -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPV6]:PORT`` (``flag``: the option named in the error)."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise BootstrapError(f"{flag} {text!r} is not HOST:PORT (e.g. 127.0.0.1:0)")
    return host, int(port)


def read_bootstrap_list(path: pathlib.Path | str) -> list[str]:
    """One multiaddr per line; ``#`` starts a comment."""
    out = []
    for line in pathlib.Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(line)
    return out


def bootstrap_addrs(flags: Iterable[str] | None, env: Mapping[str, str] | None = None) -> list[Multiaddr]:
    """Bootstrap peers from ``--bootstrap`` flags, else ``$MESHNET_BOOTSTRAP``
    (space or comma separated), else the default list file. Each must be a UDP
    multiaddr naming the peer ID that will be checked when it answers."""
    env = os.environ if env is None else env
    texts = list(flags or [])
    if not texts and env.get(ENV_BOOTSTRAP):
        texts = env[ENV_BOOTSTRAP].replace(",", " ").split()
    if not texts and DEFAULT_LIST.exists():
        texts = read_bootstrap_list(DEFAULT_LIST)
    addrs = []
    for text in texts:
        try:
            addr = Multiaddr.parse(text)
        except MultiaddrError as e:
            raise BootstrapError(f"bad bootstrap address: {e}") from None
        if addr.transport != "udp" or addr.peer_id is None or addr.host is None:
            raise BootstrapError(f"bootstrap address {text!r} must be /ip4|ip6|dns4/<host>/udp/<port>/p2p/<peer id>")
        addrs.append(addr)
    return addrs


BOOTSTRAP_RETRY_TIMEOUTS_S = (1.0, 2.0)  # pings again, waiting longer, before none answered is believed


def contact_of(addr: Multiaddr) -> Contact:
    return Contact.of(addr.peer_id, addr.host, addr.port)


def node_multiaddrs(node: DHTNode) -> list[Multiaddr]:
    """Every address the node answers at, loopback last: its own, or for a node
    bound to a wildcard (no ``listen``) one per local address (local_addrs)."""
    host, port = node.addr
    return listen_multiaddrs(host, "udp", port, node.peer_id)


def node_multiaddr(node: DHTNode) -> Multiaddr:
    """The address to reach the node at from this machine: its own, or loopback for a wildcard."""
    return node_multiaddrs(node)[-1]


async def start_node(
    nursery: trio.Nursery,
    identity: Identity,
    *,
    listen: str | None = None,
    bootstrap: Iterable[str | Multiaddr] = (),
    client_mode: bool = False,
    types: Mapping[str, PayloadType] = TYPES,
    require_bootstrap: bool = True,
    serve: Callable[[DHTNode], Any] | None = None,
    follow_all: bool = False,
) -> DHTNode:
    """Bind, start and (if bootstrap peers are given) join. Raises
    :class:`BootstrapError` if none of the bootstrap peers answered with the key
    its multiaddr names. Without ``listen``, the node binds every local address
    (a client reaching bootstrap peers on other hosts; nobody dials a client).
    ``serve``: registers the role's request kinds on the node before it starts
    (DHTNode.serve_requests; e.g. reachability.dial_checks: this node checks, for
    peers that ask, whether their data-plane address answers). ``follow_all``:
    gossip every topic (a bootstrap peer, a monitor); otherwise only those the
    node publishes, reads or subscribes to (DHTNode.follow): a volunteer holds
    and pulls its own model's reports, not every model's."""
    bootstrap = [a if isinstance(a, Multiaddr) else Multiaddr.parse(a) for a in bootstrap]
    if listen is None:
        listen = "[::]:0" if any(a.components[0][0] == "ip6" for a in bootstrap) else "0.0.0.0:0"
    host, port = parse_listen(listen)
    transport = await UdpTransport.bind(host, port)
    node = DHTNode(identity, transport, types, DHTConfig(client_mode=client_mode, follow_all=follow_all),
                   lifetime_cap=lifetime_cap,  # evidence for models nobody announces lives minutes
                   source_cap=source_cap)  # fraud reports: a few a source network per accused peer
    if serve is not None:
        serve(node)
    await nursery.start(node.run)
    seeds = [contact_of(a) for a in bootstrap]
    seeds = [c for c in seeds if c.peer_id != identity.peer_id]
    if seeds:
        answered = await node.bootstrap(seeds)
        for timeout in BOOTSTRAP_RETRY_TIMEOUTS_S:  # a loaded bootstrap host answers late, not never
            if answered:
                break
            answered = await node.bootstrap(seeds, timeout=timeout)
        if answered == 0 and require_bootstrap:
            node.stop()
            raise BootstrapError(f"none of the {len(seeds)} bootstrap peers answered (or they answered with another key)")
    return node


async def peers_for_model(node: DHTNode, model_digest: str) -> list[Record]:
    """Live capability reports for a model: what gossip brought, plus a DHT lookup."""
    key = model_key(model_digest)
    found = keep_newest({r.signer.multihash: r for r in node.records(key)}, await node.get(key))
    return sorted(found.values(), key=lambda r: r.content["layers"][0])


def advertised_host(listen_host: str, bootstrap) -> str:
    """Where others dial a peer that listens on ``listen_host``: that host, or for a
    wildcard the local address this machine reaches its bootstrap peers from (its
    own public address, or its LAN address behind NAT: then dial-backs say so), of the
    wildcard's family (the data plane's and the relay's IPv6 sockets are v6-only);
    loopback when no bootstrap peer of that family is routable."""
    if not is_wildcard(listen_host):
        return listen_host
    for b in bootstrap:
        a = Multiaddr.parse(b) if isinstance(b, str) else b
        if a.host is None or ip_of(a.host) is None:
            continue
        if (":" in a.host) != (":" in listen_host):
            continue  # a route of the other family names an address this socket does not answer at (v6only)
        family = socket.AF_INET6 if ":" in a.host else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((a.host, a.port or 9))  # no datagram is sent: this only picks the route
                return s.getsockname()[0]
        except OSError:
            continue
    return "::1" if ":" in listen_host else "127.0.0.1"
