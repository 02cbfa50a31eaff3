"""Dial-back results (AutoNAT-style reachability checks), as pure data.

A peer about to announce a data-plane address asks several other peers to
dial it back (a ``dial_back`` DHT request, carrying a fresh nonce, that
:mod:`.dialer` serves). Each dialer answers (a ``dial_result``) with a
``meshnet/dialback/v1`` record it signs::

    {"subject": requester peer id, "nonce": the request's nonce,
     "results": [[addr, ok, reason], ...],  # the addresses asked, in order
     "observed": the requester's source IP as the dialer saw it}

Here: the request and answer bodies (:func:`parse_dial_back`,
:func:`parse_dial_result`), the record type and its validator (never raises),
the checks a dialer makes before dialling an address (:func:`dial_target`), what an asker checks
before believing an answer (:func:`verify_dial_result`), and the decision over
several dialers' answers (:func:`decide`), which one lying dialer cannot turn
when three or more answered. No I/O: ``dialer.py`` (the dialer) and
``reachability.py`` (the asker) do that.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from meshnet_p2p.core.errors import MeshnetError, sanitize
from meshnet_p2p.core.identity import Identity, IdentityError, PeerId
from meshnet_p2p.core.multiaddr import Multiaddr, MultiaddrError, ip_of
from meshnet_p2p.core.records import PayloadType, RecordRejected, RecordVerifier, sign_record, never_raising
from meshnet_p2p.dht.wire import BadDatagram

# the DHT request kind and its answer's
DIAL_BACK = "dial_back"  # {"addrs": [multiaddr, ...], "nonce": 16 bytes}: "dial these back, tell me (signed) what answered"
DIAL_RESULT = "dial_result"  # {"result": a signed meshnet/dialback/v1 record} or {"refused": why}

DIALBACK = "meshnet/dialback/v1"
DIALBACK_TTL_MS = 60_000  # an answer to one request, read at once
MAX_DIALBACK_LIFETIME_MS = 5 * 60_000
MAX_ADDRS = 4
MAX_ADDR_CHARS = 512
NONCE_BYTES = 16
MAX_REASON_CHARS = 64  # in a result, and a refusal's
MAX_RESULT_BYTES = 4096  # the signed record in a dial_result (well under one datagram)
MAX_OBSERVED_CHARS = 64
_FIELDS = {"subject", "nonce", "results", "observed"}

# what a dialer puts in a result
OK = "ok"
NOT_FROM_SOURCE = "not the address the request came from"
NOT_A_RELAY_TO_DIAL = "a relay address this dialer does not dial"  # (a network the asker is not in: may_dial)

# why a dialer refuses a whole request (the dial_result's "refused"; each counted as dial_back_refused_<reason>)
NOT_A_DIALER = "not a dialer"
BUSY = "busy"
RATE_LIMITED = "rate limited"
DNS_NAME = "dns name"
NOT_TCP = "not a direct tcp address"
PORT_ZERO = "port 0"
ANOTHER_PEER = "another peer's address"
NOT_A_MULTIADDR = "not a multiaddr"  # the dialer drops such a request as malformed (BadDatagram)
KNOWN_REFUSALS = frozenset({NOT_A_DIALER, BUSY, RATE_LIMITED, DNS_NAME, NOT_TCP, PORT_ZERO, ANOTHER_PEER})

REACHABLE, UNREACHABLE, UNKNOWN = "reachable", "unreachable", "unknown"


class DialbackRejected(MeshnetError):
    """An answer not to be believed; ``reason`` is one of a fixed few (countable)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        super().__init__(f"dial-back result discarded ({reason}){': ' + detail if detail else ''}")


# --- the request and answer bodies ------------------------------------------------------------


def parse_dial_back(body: dict[str, Any]) -> tuple[list[str], bytes]:
    """A dial_back request's addresses (1 to 4 distinct strings of at most 512
    chars, not yet parsed as multiaddrs) and its 16-byte nonce; BadDatagram for
    anything else. Other keys (cookie, client) are the envelope's business."""
    addrs = body.get("addrs")
    if not isinstance(addrs, list) or not 1 <= len(addrs) <= MAX_ADDRS:
        raise BadDatagram(f"addrs must be a list of 1 to {MAX_ADDRS} multiaddrs")
    if not all(isinstance(a, str) and len(a) <= MAX_ADDR_CHARS for a in addrs):
        raise BadDatagram(f"each of addrs must be a str of at most {MAX_ADDR_CHARS} chars")
    if len(set(addrs)) != len(addrs):
        raise BadDatagram("addrs has duplicates")
    nonce = body.get("nonce")
    if not (isinstance(nonce, bytes) and len(nonce) == NONCE_BYTES):
        raise BadDatagram(f"nonce must be {NONCE_BYTES} bytes")
    return list(addrs), nonce


def parse_dial_result(body: dict[str, Any]) -> tuple[bytes | None, str | None]:
    """A dial_result's (signed record, None) or (None, refusal reason); exactly
    one of the two. The record is only bytes here: the asker verifies it."""
    result, refused = body.get("result"), body.get("refused")
    if (result is None) == (refused is None):
        raise BadDatagram("a dial_result carries exactly one of result and refused")
    if result is not None:
        if not (isinstance(result, bytes) and len(result) <= MAX_RESULT_BYTES):
            raise BadDatagram(f"result must be a signed record of at most {MAX_RESULT_BYTES} bytes")
        return result, None
    if not (isinstance(refused, str) and len(refused) <= MAX_REASON_CHARS):
        raise BadDatagram(f"refused must be a str of at most {MAX_REASON_CHARS} chars")
    return None, refused


# --- the record --------------------------------------------------------------------------------


def _why(c: Mapping[str, Any]) -> str | None:
    if not isinstance(c, Mapping):
        return "content is not a map"
    if set(c) != _FIELDS:
        return "fields must be exactly subject, nonce, results, observed"
    subject = c["subject"]
    if not (isinstance(subject, str) and 0 < len(subject) <= 128):
        return "subject must be a peer ID string"
    try:
        PeerId.from_string(subject)
    except IdentityError:
        return "subject must be a peer ID string"
    if not (isinstance(c["nonce"], bytes) and len(c["nonce"]) == NONCE_BYTES):
        return f"nonce must be {NONCE_BYTES} bytes"
    results = c["results"]
    if not (isinstance(results, list) and 1 <= len(results) <= MAX_ADDRS):
        return f"results must be a list of 1 to {MAX_ADDRS} entries"
    for r in results:
        if not (isinstance(r, list) and len(r) == 3 and isinstance(r[0], str) and len(r[0]) <= MAX_ADDR_CHARS
                and isinstance(r[1], bool) and isinstance(r[2], str) and len(r[2]) <= MAX_REASON_CHARS):
            return f"each result must be [addr (<= {MAX_ADDR_CHARS} chars), ok, reason (<= {MAX_REASON_CHARS} chars)]"
    if len({r[0] for r in results}) != len(results):
        return "results name an address twice"
    observed = c["observed"]
    if not (isinstance(observed, str) and len(observed) <= MAX_OBSERVED_CHARS and ip_of(observed) is not None):
        return "observed must be an IP address"
    return None


# Why a dial-back record's content is malformed (a short reason), or None.
valid_content = never_raising(_why)


# The dialer signs; the subject is someone else, so no field claims the signer.
DIALBACK_TYPE = PayloadType(DIALBACK, max_payload_bytes=3072, claimed_peer_field=None, validate=valid_content,
                            max_lifetime_ms=MAX_DIALBACK_LIFETIME_MS)
TYPES = {DIALBACK: DIALBACK_TYPE}


def sign_dial_result(identity: Identity, subject: PeerId, nonce: bytes, results: Sequence[tuple[str, bool, str]],
                     observed: str, *, now_ms: int, ttl_ms: int = DIALBACK_TTL_MS) -> bytes:
    """The dialer's signed answer (reasons cut to 64 chars)."""
    content = {"subject": str(subject), "nonce": nonce, "observed": observed,
               "results": [[a, bool(ok), str(why)[:MAX_REASON_CHARS]] for a, ok, why in results]}
    return sign_record(identity, DIALBACK, content, seq=now_ms, now_ms=now_ms, ttl_ms=ttl_ms)


# --- the dialer: which addresses it will dial --------------------------------------------------


def dial_target(text: str, requester: PeerId) -> tuple[Multiaddr | None, str | None]:
    """``text`` as an address a dialer may dial for ``requester``, or the refusal
    reason: an IP and a tcp port other than 0 ending in the requester's /p2p, or
    the requester reached through a relay at such an address
    (``/ip4/R/tcp/P/p2p/RELAY/p2p-circuit/p2p/REQUESTER``, the circuit address a
    relayed peer announces: its relay's check by others, which a relay cannot
    tell from a client's). Whether the dialer dials it is its other check
    (:func:`may_dial`)."""
    try:
        addr = Multiaddr.parse(text)
    except (MultiaddrError, IdentityError, ValueError):
        return None, NOT_A_MULTIADDR
    protos = [p for p, _ in addr.components]
    if any(p in ("dns", "dns4", "dns6") for p in protos):
        return None, DNS_NAME
    circuit = protos[1:] == ["tcp", "p2p", "p2p-circuit", "p2p"]
    if addr.transport != "tcp" or addr.host is None or protos[0] not in ("ip4", "ip6") \
            or ("p2p-circuit" in protos and not circuit):
        return None, NOT_TCP
    if addr.port == 0:
        return None, PORT_ZERO
    if (protos.count("p2p") != 1 and not circuit) or addr.peer_id != requester:
        return None, ANOTHER_PEER
    return addr, None


def relay_of(addr: Multiaddr) -> Multiaddr | None:
    """The relay a circuit address goes through (its part before /p2p-circuit), or None."""
    protos = [p for p, _ in addr.components]
    return Multiaddr(addr.components[:protos.index("p2p-circuit")]) if "p2p-circuit" in protos else None


def may_dial(target: Multiaddr, source: str) -> tuple[bool, str]:
    """Whether a dialer dials ``target`` (from :func:`dial_target`) for a request
    from ``source`` (an IP), and the result's reason when not. A direct address:
    only at the request's own IP (libp2p AutoNAT's rule: a dialer is nobody's
    reflector). Through a relay: the relay is who gets dialled, whoever asks
    (bounded as every request is, per source network), but never an address
    inside a private or loopback network unless the request came from one of the
    same kind (a LAN, a test swarm): no asker aims a dialer at its own LAN."""
    relay = relay_of(target)
    if relay is None:
        return (True, OK) if same_ip(target.host, source) else (False, NOT_FROM_SOURCE)
    rip, sip = ip_of(relay.host or ""), ip_of(source)
    if rip is None or sip is None or rip.is_unspecified or rip.is_link_local or rip.is_multicast:
        return False, NOT_A_RELAY_TO_DIAL
    if rip.is_loopback and not sip.is_loopback or rip.is_private and not sip.is_private:
        return False, NOT_A_RELAY_TO_DIAL
    return True, OK


def same_ip(a: str, b: str) -> bool:
    ia, ib = ip_of(a), ip_of(b)
    return ia is not None and ia == ib


# --- the asker: what it believes ---------------------------------------------------------------


@dataclass(frozen=True)
class DialReport:
    """One dialer's verified answer: the evidence a decision rests on."""

    dialer: PeerId
    results: tuple[tuple[str, bool, str], ...]
    observed: str
    record: bytes  # the signed record, for anyone to check again


def verify_dial_result(record_wire: bytes, *, dialer: PeerId, subject: PeerId, nonce: bytes, addrs: Sequence[str],
                       now_ms: int) -> DialReport:
    """Believe a dial_result only if it is a valid dial-back record, signed by the
    peer that was asked, about this asker, with the nonce it sent and results for
    exactly the addresses it asked about (in order). Raises
    :class:`DialbackRejected` otherwise, never anything else."""
    try:
        rec = RecordVerifier(TYPES).verify(record_wire, now_ms, remember=False)
    except RecordRejected as e:
        raise DialbackRejected(f"record {e.reason.value}", e.detail[:120]) from None
    if rec.signer != dialer:
        raise DialbackRejected("signed by another peer", f"{rec.signer} answered for {dialer}")
    c = rec.content
    if c["subject"] != str(subject):
        raise DialbackRejected("another subject")
    if c["nonce"] != nonce:
        raise DialbackRejected("another nonce")
    if [r[0] for r in c["results"]] != list(addrs):
        raise DialbackRejected("other addresses")
    return DialReport(dialer, tuple((a, ok, why) for a, ok, why in c["results"]), c["observed"], record_wire)


# --- the decision ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reachability:
    """What the dialers' verified answers say. ``reason`` is safe to print; the
    reasons inside ``evidence`` and ``refused`` are the dialers' own text."""

    status: str  # REACHABLE | UNREACHABLE | UNKNOWN
    reason: str  # one line, for a human
    reachable: tuple[str, ...]  # the addresses found reachable, in the order asked
    evidence: tuple[DialReport, ...]  # every verified answer, one per dialer
    observed: str | None  # the source IP the dialers agree they saw (as the same rule decides), else None
    asked: int  # dialers asked
    refused: tuple[tuple[PeerId, str], ...] = ()  # dialers that refused, and why


def _majority(yes: int, no: int, only_one_asked: bool) -> bool | None:
    """True/False when the answers decide, None when they do not. At least two
    agreeing dialers and more than disagree; when only one peer could be asked,
    its answer is all there is."""
    if only_one_asked and yes + no == 1:
        return yes == 1
    if yes >= 2 and yes > no:
        return True
    if no >= 2 and no > yes:
        return False
    return None


def decide(reports: Sequence[DialReport], addrs: Sequence[str], *, asked: int,
           refused: Sequence[tuple[PeerId, str]] = ()) -> Reachability:
    """Reachability from verified answers (one counted per distinct dialer).

    An address is reachable when at least two dialers reached it and more
    reached it than did not; unreachable when at least two did not and more did
    not than did; otherwise undecided (when only one peer could be asked, its
    answer decides). So with three or more answers, one lying dialer is
    outvoted whichever way it lies; with two, it can only make the answer
    "unknown". The peer is reachable if some address is, unreachable if every
    address is, unknown otherwise (nobody answered, or the dialers disagree)."""
    by_dialer: dict[bytes, DialReport] = {}
    for r in reports:
        if [a for a, _, _ in r.results] == list(addrs):  # (verified answers always are about these)
            by_dialer.setdefault(r.dialer.multihash, r)  # a dialer counts once
    evidence = tuple(by_dialer.values())
    only_one = asked <= 1
    refused = tuple(refused)
    if not evidence:
        why = f"no verified answer from the {asked} peers asked" if not refused else \
            f"no dialer answered ({len(refused)} of {asked} refused: {sanitize(refused[0][1], MAX_REASON_CHARS)})"
        return Reachability(UNKNOWN, why if asked else "no peers to ask", (), (), None, asked, refused)
    reachable, unreachable, why_not = [], [], Counter()
    for i, addr in enumerate(addrs):
        yes = sum(1 for r in evidence if r.results[i][1])
        no = len(evidence) - yes
        verdict = _majority(yes, no, only_one)
        if verdict is True:
            reachable.append(addr)
        elif verdict is False:
            unreachable.append(addr)
            why_not.update(r.results[i][2] for r in evidence if not r.results[i][1])
    seen = Counter(r.observed for r in evidence).most_common()
    observed = None
    if seen:
        others = sum(n for _, n in seen[1:])
        if _majority(seen[0][1], others, only_one):
            observed = seen[0][0]
    n = len(evidence)
    if reachable:
        yes = sum(1 for r in evidence if r.results[addrs.index(reachable[0])][1])
        return Reachability(REACHABLE, f"{yes} of {n} dialers reached {reachable[0]}", tuple(reachable), evidence,
                            observed, asked, refused)
    if len(unreachable) == len(addrs):
        common = sanitize(why_not.most_common(1)[0][0], MAX_REASON_CHARS) if why_not else "no answer"
        return Reachability(UNREACHABLE, f"{n} dialers could not reach any address ({common})", (), evidence, observed,
                            asked, refused)
    return Reachability(UNKNOWN, f"the {n} dialers that answered do not agree, or too few answered", (), evidence,
                        observed, asked, refused)
