"""Can others dial the data-plane address this peer would announce? (AutoNAT-style)

A volunteer asks several other server-mode peers from its routing table
(distinct networks first, bootstrap peers only if too few others exist) to
dial its addresses back (a ``dial_back`` DHT request, a fresh nonce each). Each
dialer answers with a result it signs (``meshnet/dialback/v1``, see
:mod:`meshnet_p2p.nat.dialback`); answers that do not verify, or are about another
asker, nonce or address list, are discarded and counted, never believed.
:func:`meshnet_p2p.nat.dialback.decide` turns the verified answers into
reachable / unreachable / unknown, so that one lying dialer cannot turn the
outcome once three answered.

:func:`tls_dial_check` is the dial itself, which a dialer
(:mod:`meshnet_p2p.nat.dialer`) runs for others; roles make their DHT node one
with :func:`dial_checks` (``start_node(..., serve=dial_checks)``): a TCP connection and a TLS
handshake (ALPN h2) whose certificate must carry the asker's identity. No
client certificate, no gRPC: completing the handshake proves the holder of the
certificate's key answered, and the certificate's libp2p extension proves
whose key that is.

    dial_checks(node)                          # this node dials others back
    found = await check_reachability(node, [str(my_tcp_multiaddr)], avoid=bootstrap_ids)
    if found.status == "reachable": announce found.reachable
"""

from __future__ import annotations

import os
import random
import ssl
from collections.abc import Iterable, Sequence

import trio

from meshnet_p2p.dataplane.transport.connect import ConnectDialog, ConnectError, relay_target
from meshnet_p2p.dataplane.transport.tls import TLS_NAME, TlsBindingError, client_context, peer_of_der
from meshnet_p2p.dht import wire
from meshnet_p2p.dht.node import DHTNode
from meshnet_p2p.dht.routing import Contact
from meshnet_p2p.core.netgroup import network_of
from .dialback import (
    DIAL_BACK,
    DIAL_RESULT,
    KNOWN_REFUSALS,
    MAX_ADDRS,
    NONCE_BYTES,
    DialbackRejected,
    DialReport,
    Reachability,
    REACHABLE,
    UNREACHABLE,
    decide,
    dial_target,
    relay_of,
    parse_dial_result,
    verify_dial_result,
)
from .dialer import DIAL_TIMEOUT, DialBackServer, serve_dial_backs
from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.core.identity import PeerId
from meshnet_p2p.core.multiaddr import Multiaddr
from meshnet_p2p.swarm.relay_offers import circuit_addr

DEFAULT_DIALERS = 3
CHECK_TIMEOUT = 5.0  # a dialer's dials take up to 3 s (dialer.DIAL_TIMEOUT), then its answer travels
RELAY_DIAL_TIMEOUT = 5.0  # through a relay: its CONNECT, its OPEN to the peer, the peer's attach, then TLS
MAX_RELAY_ANSWER = 4096  # the relay's answer to CONNECT

__all__ = ["Reachability", "DialReport", "ReachabilityError", "check_reachability", "choose_dialers", "tls_dial_check",
           "relay_dial_check", "relay_check", "dial_checks"]


class ReachabilityError(MeshnetError):
    """The addresses to check are not ones any dialer would dial."""


# --- the dialer's dial ------------------------------------------------------------------------


def dial_checks(node: DHTNode) -> DialBackServer:
    """Make ``node`` a dialer for others' reachability checks, dialling with
    :func:`tls_dial_check` (a role's ``start_node(..., serve=dial_checks)``)."""
    return serve_dial_backs(node, tls_dial_check)


# client_context(None): the certificate is self-signed and nobody's root, so the check
# is the identity extension (peer_of_der), and the handshake proves the server holds its key.


async def tls_dial_check(peer_id: PeerId, addr_text: str, timeout: float = DIAL_TIMEOUT, *,
                         local_address: str | None = None) -> tuple[bool, str]:
    """Dial ``addr_text`` (an /ip4 or /ip6 tcp multiaddr) and check that whoever
    answers completes a TLS handshake (ALPN h2) with a certificate bound to
    ``peer_id``. Returns (True, "ok") or (False, a short reason: "bad address",
    "refused", "unreachable", "timeout", "tls failed", "not h2", "no peer
    identity", "another peer's certificate"). Never raises on network errors.
    A circuit address (``.../p2p-circuit/p2p/<peer>``) is dialled through its
    relay (:func:`relay_dial_check`). ``local_address``: the source IP to dial
    from (a host with several), else the system's choice."""
    target, _ = dial_target(addr_text, peer_id)
    if target is None:
        return False, "bad address"
    relay = relay_of(target)
    if relay is not None:
        return await relay_dial_check(peer_id, relay, timeout, local_address=local_address)
    family = trio.socket.AF_INET6 if ":" in target.host else trio.socket.AF_INET
    stream: trio.SSLStream | None = None
    outcome: tuple[bool, str] = (False, "timeout")
    with trio.move_on_after(timeout):
        try:
            sock = trio.socket.socket(family, trio.socket.SOCK_STREAM)
            try:
                if local_address is not None:
                    await sock.bind((local_address, 0))
                await sock.connect((target.host, target.port))
            except BaseException:
                sock.close()
                raise
            stream = trio.SSLStream(trio.SocketStream(sock), client_context(None), server_hostname=TLS_NAME)
            await stream.do_handshake()
            outcome = _identity_outcome(stream, peer_id)
        except ConnectionRefusedError:
            outcome = (False, "refused")
        except (trio.BrokenResourceError, ssl.SSLError):  # (SSLError is an OSError: first)
            outcome = (False, "tls failed")
        except OSError:
            outcome = (False, "unreachable")
    if stream is not None:  # close_notify if it goes out at once; the socket closes either way
        with trio.move_on_after(0.2):
            try:
                await stream.aclose()
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
        await trio.aclose_forcefully(stream.transport_stream)
    return outcome


async def relay_dial_check(peer_id: PeerId, relay: Multiaddr, timeout: float = RELAY_DIAL_TIMEOUT, *,
                           local_address: str | None = None) -> tuple[bool, str]:
    """Dial ``peer_id`` through ``relay`` as a client would (``CONNECT <peer>.peer:443``),
    and check that whoever answers completes a TLS handshake with a certificate
    bound to ``peer_id``: the relay really carries connections to it. A peer runs
    this on itself, to catch a relay that takes a reservation and then forwards
    nothing. Returns (True, "ok") or (False, a short reason). Never raises on
    network errors."""
    if relay.host is None or not relay.port:
        return False, "bad address"
    stream: trio.SSLStream | None = None
    raw = None
    outcome: tuple[bool, str] = (False, "timeout")
    with trio.move_on_after(timeout):
        try:
            raw = await trio.open_tcp_stream(relay.host, relay.port, local_address=local_address)
            dialog = ConnectDialog(relay_target(peer_id), max_answer=MAX_RELAY_ANSWER)
            await raw.send_all(dialog.request)
            # the relay's answer a byte at a time: TLS follows it on this stream, and
            # SSLStream could not be handed bytes read past the answer
            while dialog.receive(await raw.receive_some(1)) is None:
                pass
            stream = trio.SSLStream(raw, client_context(None), server_hostname=TLS_NAME)
            await stream.do_handshake()
            outcome = _identity_outcome(stream, peer_id)
        except ConnectError as e:
            outcome = (False, "the relay refused: " + e.answer[:40]) if e.status is not None else (False, "the relay closed")
        except (trio.BrokenResourceError, ssl.SSLError):
            outcome = (False, "tls failed" if stream is not None else "the relay closed")
        except OSError:
            outcome = (False, "unreachable")
    if raw is not None:
        await trio.aclose_forcefully(raw)
    return outcome


RELAY_CHECK_TRIES = 2  # samples of dialers a relay check asks before it dials itself


def relay_check(node: DHTNode, *, avoid: Iterable[PeerId] = (), fallback=relay_dial_check):
    """A :class:`~meshnet_p2p.nat.keeper.RelayKeeper`'s ``verify`` that where a
    dial comes from cannot fool: other peers dial this one through the relay (a
    ``dial_back`` of its circuit address, :func:`check_reachability`), a second
    sample of them when the first does not decide, and only when that does not
    either (or nobody could be asked) does it dial itself (``fallback``). A relay
    sees each dial's source: one that carries what comes from the reserved
    peer's own address and drops everyone else's passes a self-dial every time
    (docs/scale.md)."""
    avoid = tuple(avoid)

    async def verify(peer_id: PeerId, relay: Multiaddr) -> tuple[bool, str]:
        # Undecided (dialers gone since they were last heard from, one answer too few): others
        # are asked once more before the self-dial, which a relay carrying only its peer's own
        # dials passes. The simulator found a volunteer kept on such a relay for a minute by
        # one dialer's answer (it could not reach it) and a self-dial (docs/scale.md).
        for _ in range(RELAY_CHECK_TRIES):
            found = await check_reachability(node, [circuit_addr(relay, peer_id)], avoid=avoid)
            if found.status == REACHABLE:
                return True, "ok"
            if found.status == UNREACHABLE:
                return False, f"others could not reach this peer through it: {found.reason}"
            if not found.asked:  # nobody to ask: asking again finds nobody either
                break
        return await fallback(peer_id, relay)

    return verify


def _identity_outcome(stream: trio.SSLStream, peer_id: PeerId) -> tuple[bool, str]:
    if stream.selected_alpn_protocol() != "h2":
        return False, "not h2"
    try:
        owner = peer_of_der(stream.getpeercert(binary_form=True))
    except TlsBindingError:
        return False, "no peer identity"
    if owner is None:
        return False, "no peer identity"
    if owner != peer_id:
        return False, "another peer's certificate"
    return True, "ok"


# --- the asker --------------------------------------------------------------------------------


def choose_dialers(contacts: Iterable[Contact], want: int = DEFAULT_DIALERS, avoid: Iterable[PeerId] = (),
                   rng: random.Random | None = None) -> list[Contact]:
    """Up to ``want`` distinct peers to ask, at random: first one per network
    (an IPv4 /24 or IPv6 /48 for public addresses, the address itself
    otherwise), then more from networks already chosen; peers in ``avoid``
    (bootstrap peers) only if too few others exist. Pure."""
    rng = rng or random.Random(random.getrandbits(64))  # from the process's generator: a seeded simulation repeats
    avoid = {p.multihash for p in avoid}
    pool = list({c.peer_id.multihash: c for c in contacts}.values())
    rng.shuffle(pool)
    chosen: list[Contact] = []
    networks: set[str] = set()
    for group in ([c for c in pool if c.peer_id.multihash not in avoid], [c for c in pool if c.peer_id.multihash in avoid]):
        for c in group:  # one per network first
            net = network_of(c.host)
            if len(chosen) < want and net not in networks:
                chosen.append(c)
                networks.add(net)
        for c in group:
            if len(chosen) < want and c not in chosen:
                chosen.append(c)
    return chosen


def _checked_addrs(addrs: Sequence[str], me: PeerId) -> list[str]:
    addrs = list(dict.fromkeys(addrs))
    if not 1 <= len(addrs) <= MAX_ADDRS:
        raise ReachabilityError(f"check 1 to {MAX_ADDRS} addresses at once, not {len(addrs)}")
    for a in addrs:
        if not isinstance(a, str):
            raise ReachabilityError(f"{a!r} is not a multiaddr string")
        _, why = dial_target(a, me)
        if why is not None:
            raise ReachabilityError(f"{a[:120]!r} cannot be dialled back: {why} (an IP, a tcp port, /p2p/{me})")
    return addrs


def _count(node: DHTNode, key: str) -> None:
    node.stats[key.replace(" ", "_")] += 1


async def check_reachability(node: DHTNode, addrs: Sequence[str], *, want: int = DEFAULT_DIALERS,
                             timeout: float = CHECK_TIMEOUT, avoid: Iterable[PeerId] = (),
                             rng: random.Random | None = None) -> Reachability:
    """Ask up to ``want`` peers from ``node``'s routing table (see
    :func:`choose_dialers`) to dial ``addrs`` (this peer's tcp multiaddrs, at
    most 4) back, in parallel, each within ``timeout``; believe only verified
    answers (:func:`meshnet_p2p.nat.dialback.verify_dial_result`) and decide
    (:func:`meshnet_p2p.nat.dialback.decide`). Raises :class:`ReachabilityError`
    for addresses no dialer would dial; network trouble only makes answers
    missing (the result is then "unknown" or rests on fewer dialers).
    Counted in ``node.stats``: reachability_asked, _answered, _silent,
    _refused_<why>, _discarded_<why>."""
    addrs = _checked_addrs(addrs, node.peer_id)
    dialers = choose_dialers(node.table.contacts(), want, avoid, rng)
    reports: dict[int, DialReport] = {}
    refused: dict[int, tuple[PeerId, str]] = {}

    async def ask(i: int, c: Contact) -> None:
        nonce = os.urandom(NONCE_BYTES)
        _count(node, "reachability_asked")
        reply = None
        with trio.move_on_after(timeout):  # (a cookie round trip included)
            reply = await node.request(c, DIAL_BACK, {"addrs": addrs, "nonce": nonce}, timeout=timeout)
        if reply is None or reply.kind != DIAL_RESULT:
            _count(node, "reachability_silent")
            return
        try:
            record, why = parse_dial_result(reply.body)
        except wire.BadDatagram:
            _count(node, "reachability_discarded_malformed")
            return
        if why is not None:
            # a dialer's own words: counted under a fixed set of names, never as a new key per text
            _count(node, "reachability_refused_" + (why if why in KNOWN_REFUSALS else "other"))
            refused[i] = (c.peer_id, why)
            return
        try:
            reports[i] = verify_dial_result(record, dialer=c.peer_id, subject=node.peer_id, nonce=nonce, addrs=addrs,
                                            now_ms=node.now_ms())
        except DialbackRejected as e:
            _count(node, "reachability_discarded_" + e.reason)
            return
        _count(node, "reachability_answered")

    async with trio.open_nursery() as nursery:
        for i, c in enumerate(dialers):
            nursery.start_soon(ask, i, c)
    return decide([reports[i] for i in sorted(reports)], addrs, asked=len(dialers),
                  refused=[refused[i] for i in sorted(refused)])
