"""The client: find a route through the swarm and generate tokens through it.

    client = Client(bootstrap=["/ip4/127.0.0.1/udp/4001/p2p/12D3KooW..."])
    result = client.generate("The capital of France is", max_tokens=32)   # plain code
    result = await client.agenerate(...)                                  # from trio

Discovery: a DHT node in client mode fetches the signed capability reports
for the model; only reports that agree on the recipe form a route (a peer on
another recipe would compute other numbers). The route is the cheapest chain
of peers covering every layer (:func:`meshnet_p2p.swarm.placement.plan_route`).

By default the route is a ring (docs/ring.md): each peer forwards its output
to the next, the tail its token to the head, and every hop sends the client
a copy, so a token costs one network crossing per hop. With ``ring=False``
(a star) the client carries every hidden state itself, two crossings a hop.
Either way the client keeps each hop's inputs. When a peer dies, stalls past
the step deadline or answers with an error, the client bans it for a while,
plans a replacement for just that span of layers, replays the span's inputs
into the replacement (rebuilding its cache), rolls a ring's other hops back
to the step that failed, and goes on. With greedy sampling (or a seed) the
output is the same as without the failure.
"""

from __future__ import annotations

import functools
import itertools
import os
import random
import threading
import time
import uuid
from concurrent import futures
from dataclasses import dataclass, field
from typing import Callable, Sequence

import trio

from meshnet_p2p._proto import shard_runtime_pb2 as pb
from meshnet_p2p.trust.attestation import SEAM_DOMAIN, Attestation, CertificationError, RowDigest
from meshnet_p2p.trust.policy import TrustPolicy
from meshnet_p2p.dataplane.stub import (
    SessionStream,
    ShardClient,
    ShardConnectionError,
    ShardError,
    lease_channel,
)
from meshnet_p2p.dataplane.transport.pool import ChannelPool
from meshnet_p2p.dataplane.ring import ATTACH_TOKEN_BYTES, LINK_TIMEOUT_S
from meshnet_p2p.dataplane.transport.tls import TlsCredentials, cert_identity, make_client_credentials
from meshnet_p2p.engine.contract import SamplingParams, TensorBundle
from meshnet_p2p.core.errors import MeshnetError, sanitize
from meshnet_p2p.core.identity import Identity, PeerId
from meshnet_p2p.core.multiaddr import Multiaddr
from meshnet_p2p.core.records import wall_ms
from .generation import Generation, generate
from meshnet_p2p.swarm.placement import NoRoute, Span, plan_route
from meshnet_p2p.core.stats import ClientStats
from meshnet_p2p.swarm.view import routable_spans, survey


class GenerationError(MeshnetError):
    pass


class RequestRefused(MeshnetError):
    """Every peer that could serve refused the request itself (it asks for more
    than they hold, or is malformed): the request's error, no peer's fault."""


def _refuses_the_request(e: MeshnetError) -> bool:
    """A refusal caused by what was asked, not by the peer: no reason to ban it."""
    return isinstance(e, ShardError) and not e.retryable and e.code_name in (
        "CAPACITY", "INVALID_ARGUMENT", "CONTEXT_EXHAUSTED")


def _is_full(e: Exception) -> bool:
    """The peer has no session to spare now (or took one back to share fairly), or
    turned the call away before any work (its per-connection or per-source
    limits, or its bound on ring links for this client): not its fault."""
    return (isinstance(e, ShardError) and e.code_name in ("CAPACITY", "LINK_LIMITED") and e.retryable) or \
        (isinstance(e, ShardConnectionError) and e.refused)


SPANS_MAX_AGE_S = 5.0  # a generation may start from a survey this recent (a failover always surveys afresh)
REPORT_MARGIN_MS = 15_000  # a ring link sends a report at least this far from expiry (a peer checks it)
CONNECT_TIMEOUT_S = 3.0  # a candidate's first contact (TCP, TLS, GetCapability)
PROBE_WIDTH = 16  # first contacts at once, once a search has met a failing candidate
MAX_OPEN_TRIES = 1024  # candidates one route search may set aside (a refused dial costs ~1 ms; open_timeout bounds the rest)


BACKOFF_BASE_S = 0.25  # the first wait for busy peers; doubling to BACKOFF_MAX_S
BACKOFF_MAX_S = 4.0


def _backoff(waits: int, hint_s: float) -> float:
    """How long to wait before asking busy peers again: exponential, at least
    their own hint (bounded: a hint costs a peer nothing to inflate), jittered so
    clients turned away together do not come back together."""
    base = max(min(BACKOFF_BASE_S * 2 ** waits, BACKOFF_MAX_S), min(hint_s, BACKOFF_MAX_S))
    return base * random.uniform(0.75, 1.25)


def _tried_text(tried: dict[str, str]) -> str:
    if not tried:
        return ""
    shown = "; ".join(f"{peer[-8:]}: {sanitize(why)[:120]}" for peer, why in list(tried.items())[:4])
    more = f" and {len(tried) - 4} more" if len(tried) > 4 else ""
    return f" (tried {len(tried)} peers: {shown}{more})"


@dataclass
class GenerationResult(Generation):
    """A generation through the swarm: the local one's figures, plus its text and route."""

    text: str = ""
    route: list[dict] = field(default_factory=list)
    failovers: int = 0


@dataclass
class _Contact:
    span: Span
    client: ShardClient  # connected, its peer checked against its report
    cap: pb.Capability


@dataclass
class _Hop:
    span: Span
    client: ShardClient
    stream: SessionStream
    n_ubatch: int  # the route's recipe: prefill steps must be whole micro-batches of it
    history: list[tuple[int, object, bool]] = field(default_factory=list)  # (position, input, decode)
    attach_token: bytes = b""  # what the ring's previous hop attaches with (ring routes only)
    # what this hop was given and gave back, as the peer's attestation must state it
    inputs: RowDigest = field(default_factory=lambda: RowDigest(SEAM_DOMAIN))
    outputs: RowDigest = field(default_factory=lambda: RowDigest(SEAM_DOMAIN))
    steps: int = 0

    def close(self) -> None:
        try:
            self.stream.close()
        finally:
            self.client.close()


class RouteSession:
    """One generation's session across a chain of peers, with failover."""

    def __init__(self, spans_provider: Callable[[], list[Span]], n_layer: int, *, max_tokens: int,
                 sampling: SamplingParams, step_timeout: float = 10.0, max_failovers: int = 4,
                 ban_seconds: float = 60.0, on_event: Callable[[str], None] | None = None,
                 latency_ms: dict[str, float] | None = None, measured_ms: dict[str, float] | None = None,
                 planner: Callable[..., list[Span]] = plan_route, open_timeout: float = 60.0,
                 attest: bool = False, client_creds: TlsCredentials | None = None, ring: bool = False,
                 stop_at_eog: bool = True, pool: ChannelPool | None = None) -> None:
        if ring and attest:
            raise ValueError("a ring route does not attest: certification drives every hop itself")
        self.ring = ring  # peers forward to each other (docs/ring.md); else the client carries every hop
        self.pool = pool  # channels shared with the owner's other sessions (None: one connection per hop)
        self.stop_at_eog = stop_at_eog  # where the ring's tail stops feeding the head, as generate() stops
        self._ring_next: int | None = None  # the position the ring feeds the head itself next
        self.client_creds = client_creds  # the certificate presented to peers (default: this process's)
        self.open_timeout = open_timeout  # seconds to find and open a route, across candidates
        self.attest = attest  # keep each hop's digests, to check its attestation (certification only)
        self.spans_provider = spans_provider
        self.planner = planner  # plan_route, or a certifier's (at least two peers, some banned)
        self.max_tokens = max_tokens
        self.sampling = sampling
        self.step_timeout = step_timeout
        self.max_failovers = max_failovers
        self.ban_seconds = ban_seconds
        self.on_event = on_event or (lambda msg: None)
        self.session_id = uuid.uuid4().hex  # the route's own name (each hop's session has its own ID)
        self.epoch = 0
        self.banned: dict[str, float] = {}
        self.latency_ms: dict[str, float] = latency_ms if latency_ms is not None else {}
        self.measured_ms: dict[str, float] = measured_ms if measured_ms is not None else {}  # per-token, decode
        self.failovers = 0
        self.n_layer = n_layer
        self.spans = spans_provider()
        self.hops = self._open_chain(0, n_layer)
        if ring:
            try:
                self._ring_recover(0, self._link_ring())
            except BaseException:  # no session is left open on any peer
                self.close()
                raise

    # --- building the chain -------------------------------------------------------------------

    def _banned_now(self) -> set[str]:
        now = time.monotonic()
        return {p for p, until in self.banned.items() if until > now}

    def _open_chain(self, start: int, end: int) -> list[_Hop]:
        """Open a session on every hop of the cheapest route for [start, end).

        Reports cost nothing to forge, so a candidate that fails at first contact
        or session open (dead address, another peer's certificate, a handshake
        that hangs, a refusal) is set aside and the search goes on: that spends
        no failover, only time, bounded by ``open_timeout`` and MAX_OPEN_TRIES.
        First contacts run side by side: the route's new peers at once, and once
        anything has failed, up to PROBE_WIDTH candidates of the next-best
        routes with them, so lies behind addresses that hang cost their timeout
        together, not one after another. Hops already open are kept for the next
        plan. It gives up only when no untried route is left, naming what it tried."""
        tried: dict[str, str] = {}
        refused: dict[str, str] = {}  # the subset that refused the request itself
        full: dict[str, float] = {}  # the subset that was full: asked again after a wait (their hint, seconds)
        busy: dict[str, str] = {}  # what full peers said, kept for the error once the deadline passes
        waits = 0
        contacts: dict[str, _Contact] = {}  # first contact made, no session yet
        opened: dict[str, _Hop] = {}
        deadline = time.monotonic() + self.open_timeout
        rediscovered = False

        def set_aside(peer: str, e: MeshnetError) -> None:
            tried[peer] = str(e)
            if _refuses_the_request(e):  # rightly refused: set aside for this search, not banned
                refused[peer] = str(e)
            elif _is_full(e):  # busy, not faulty: tried again once the search has waited
                full[peer] = getattr(e, "retry_after_s", 0.0)
            else:  # anything else is the peer's fault
                self.banned[peer] = time.monotonic() + self.ban_seconds
            self.on_event(f"cannot open a session on {peer}: {e}")

        try:
            while True:
                if len(tried) >= MAX_OPEN_TRIES or time.monotonic() > deadline:
                    why = f"{self.open_timeout:g} s: the peers that serve them stayed busy ({waits} waits)" if waits \
                        else f"{len(tried)} tries"
                    raise GenerationError(f"could not open a route for layers {start}-{end - 1} in {why}"
                                          + _tried_text({**busy, **tried}))
                try:
                    route = self._plan(start, end, self._banned_now() | set(tried))
                except NoRoute as e:
                    if tried and not rediscovered:  # the swarm may have changed while we tried
                        rediscovered = True
                        self.spans = self.spans_provider()
                        continue
                    if full and time.monotonic() < deadline:  # busy peers: wait our turn, then ask them again
                        pause = min(_backoff(waits, max(full.values())), max(0.0, deadline - time.monotonic()))
                        self.on_event(f"every peer that serves layers {start}-{end - 1} is busy "
                                      f"({len(full)} full); asking again in {pause:.1f} s")
                        # While it waits, this search holds no session it opened (a failover's other
                        # hops stay open: their caches are this generation's; see docs/swarm.md)
                        for hop in opened.values():
                            hop.close()
                        opened.clear()
                        time.sleep(pause)
                        waits += 1
                        for peer in full:
                            busy[peer] = tried.pop(peer, "busy")
                        full.clear()
                        rediscovered = False
                        continue
                    if tried and len(refused) == len(tried):
                        raise RequestRefused(f"the request was refused by every peer that could serve layers "
                                             f"{start}-{end - 1}: {sanitize(next(iter(refused.values())))}") from None
                    waited = f" after waiting {waits} times for busy peers" if waits else ""
                    raise GenerationError(f"could not open a route for layers {start}-{end - 1}{waited}: {e}"
                                          + _tried_text(tried)) from None
                known = set(opened) | set(contacts)
                if any(s.peer_id not in known for s in route):
                    width = PROBE_WIDTH if tried else len(route)  # widen only once a candidate has failed
                    batch = self._to_contact(start, end, route, self._banned_now() | set(tried), known, width)
                    for peer, outcome in self._first_contacts(batch).items():
                        if isinstance(outcome, _Contact):
                            contacts[peer] = outcome
                        else:
                            set_aside(peer, outcome)
                    continue  # plan again with what was learned
                try:
                    for span in route:
                        if span.peer_id not in opened:
                            opened[span.peer_id] = self._start(contacts.pop(span.peer_id))
                    return [opened.pop(span.peer_id) for span in route]
                except MeshnetError as e:  # typed peer errors and broken connections included
                    set_aside(next(s.peer_id for s in route if s.peer_id not in opened), e)
        finally:
            for hop in opened.values():  # opened for a plan that was not taken
                hop.close()
            for contact in contacts.values():
                contact.client.close()

    def _plan(self, start: int, end: int, banned: set[str]) -> list[Span]:
        return self.planner(self.spans, start, end, banned=banned, latency_ms=self.latency_ms,
                            measured_ms=self.measured_ms)

    def _to_contact(self, start: int, end: int, route: list[Span], banned: set[str], known: set[str],
                    width: int) -> list[Span]:
        """The new peers of ``route``, then those of the next-best routes (each
        planned without the peers already chosen), up to ``width``."""
        batch = {s.peer_id: s for s in route if s.peer_id not in known}
        skip = banned | set(batch)
        while len(batch) < width:
            try:
                new = [s for s in self._plan(start, end, skip) if s.peer_id not in known]
            except NoRoute:
                break
            if not new:  # a route of peers already contacted: nothing more to learn here
                break
            for s in new[: width - len(batch)]:
                batch[s.peer_id] = s
            skip |= {s.peer_id for s in new}
        return list(batch.values())

    def _first_contacts(self, spans: list[Span]) -> dict[str, "_Contact | MeshnetError"]:
        """First contact with each of ``spans``' peers, side by side."""
        with futures.ThreadPoolExecutor(max_workers=max(1, len(spans)), thread_name_prefix="first-contact") as pool:
            pending = {s.peer_id: pool.submit(self._contact, s) for s in spans}
        out: dict[str, _Contact | MeshnetError] = {}
        for peer, f in pending.items():
            e = f.exception()
            out[peer] = f.result() if e is None else e
        bug = next((e for e in out.values() if isinstance(e, BaseException) and not isinstance(e, MeshnetError)), None)
        if bug is not None:  # not a peer's fault but ours: close what opened, and say so
            for c in out.values():
                if isinstance(c, _Contact):
                    c.client.close()
            raise bug
        return out

    def _contact(self, span: Span) -> "_Contact":
        """Connect, and check the peer is what its report says (raises MeshnetError)."""
        c = span.record.content
        peer = PeerId.from_string(c["peer_id"])
        # first contact: a short bound
        client = connect(span, min(self.step_timeout, CONNECT_TIMEOUT_S), self.client_creds, self.pool)
        try:
            cap = client.capability()  # also sets up the connection (TLS handshake)
            client.timeout = self.step_timeout
            t0 = time.perf_counter()
            client.health()
            self.latency_ms[span.peer_id] = (time.perf_counter() - t0) * 1000  # a round trip, used when re-planning
            if cap.fingerprint.model_digest != c["model_digest"] or cap.fingerprint.recipe_digest != c["recipe_digest"]:
                raise MeshnetError(f"{peer} serves another model or recipe than it announced")
            if (cap.layers.start, cap.layers.end) != (span.start, span.end):
                raise MeshnetError(f"{peer} serves other layers than it announced")
        except BaseException:
            client.close()
            raise
        return _Contact(span, client, cap)

    def _start(self, contact: "_Contact") -> _Hop:
        """Open this route's session on a contacted peer."""
        c, client, s = contact.span.record.content, contact.client, self.sampling
        token = os.urandom(ATTACH_TOKEN_BYTES) if self.ring else b""
        try:
            # open with the route's fingerprint, not the peer's: a peer of another recipe refuses, naming the axes
            # each hop its own random session ID: no peer on the route learns the ID another hop knows
            stream = client.session(_route_fingerprint(c), max_tokens=self.max_tokens, session_id=uuid.uuid4().hex,
                                    route_epoch=self.epoch, timeout=None,
                                    sampling=pb.Sampling(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed),
                                    attach_token=token)
        except BaseException:
            client.close()
            raise
        return _Hop(contact.span, client, stream, _n_ubatch(c, contact.cap), attach_token=token)

    # --- stepping -------------------------------------------------------------------------------

    def _through(self, hop: _Hop, position: int, payload, decode: bool):
        """One hop of a step, remembered for replay; returns what the next hop takes
        (the tail's reply at the end). A peer that froze (or a route that died)
        misses step_timeout: ShardConnectionError."""
        hidden = isinstance(payload, TensorBundle)
        given = {"hidden": payload} if hidden else {"token_ids": payload}
        t0 = time.perf_counter()
        # a ring numbers steps by position, as its peers do when they feed each other
        n = position + 1 if self.ring else None
        reply = hop.stream.step(position, decode=decode, timeout=self.step_timeout, idempotency_step=n, **given)
        if decode:  # what this peer costs per token, measured: it replaces its advertised throughput
            ms = (time.perf_counter() - t0) * 1000
            old = self.measured_ms.get(hop.span.peer_id)
            self.measured_ms[hop.span.peer_id] = ms if old is None else 0.8 * old + 0.2 * ms
        self._check_kind(hop, reply)
        hop.history.append((position, payload, decode))  # only what it really computed is replayed
        if self.attest:
            if hidden:
                hop.inputs.hidden(position, payload)
            else:
                hop.inputs.tokens(position, payload)
            if reply.hidden is not None:
                hop.outputs.hidden(position, reply.hidden)
            else:
                hop.outputs.token(reply.position - 1, reply.token_id)
            hop.steps += 1
        return reply.hidden if reply.hidden is not None else reply

    @property
    def n_ubatch(self) -> int:
        return self.hops[0].n_ubatch  # every hop serves the same recipe

    def step(self, position: int, token_ids: Sequence[int], decode: bool):
        """One step through every hop; returns the tail's reply."""
        if self.ring:
            return self._ring_step(position, tuple(token_ids), decode)
        payload: object = tuple(token_ids)
        i = 0
        while i < len(self.hops):
            try:
                payload = self._through(self.hops[i], position, payload, decode)
            except (ShardConnectionError, ShardError) as e:
                self._replace(i, e)
                continue  # retry this step on the replacement
            i += 1
        return payload

    def _replace(self, index: int, error: Exception) -> None:
        failed = self.hops[index]
        self.failovers += 1
        if self.failovers > self.max_failovers:
            raise GenerationError(f"gave up after {self.max_failovers} failovers; last: {error}")
        if not _is_full(error):  # full, not faulty: no ban
            self.banned[failed.span.peer_id] = time.monotonic() + self.ban_seconds
        self.on_event(f"peer {failed.span.peer_id} failed on layers {failed.span.start}-{failed.span.end - 1} ({error}); rerouting")
        failed.close()
        self.spans = self.spans_provider()
        self.epoch += 1
        new_hops = self._open_chain(failed.span.start, failed.span.end)
        self._replay(failed.history, new_hops)
        self.hops[index : index + 1] = new_hops

    def _replay(self, history: list[tuple[int, object, bool]], new_hops: list[_Hop]) -> None:
        """Rebuild a replacement's caches: every step the failed hop was given, through its new hops."""
        for position, payload, decode in history:
            for hop in new_hops:
                payload = self._through(hop, position, payload, decode)

    def _check_kind(self, hop: _Hop, reply) -> None:
        """A tail answers with a token, any other hop with a hidden state."""
        if (reply.token_id is None) if hop.span.end == self.n_layer else (reply.hidden is None):
            raise ShardConnectionError(f"{hop.span.peer_id} answered with the wrong kind of output for its layers")

    # --- the ring (docs/ring.md) -------------------------------------------------------------

    @property
    def _forward_until(self) -> int:
        return self.max_tokens - 1  # generate()'s last decode step is at max_tokens - 2

    def _link_ring(self) -> tuple[int, MeshnetError] | None:
        """Tell every hop where its output goes: the next hop, the tail's to the head.
        Returns the hop at fault and why, if a link could not be made."""
        k = len(self.hops)
        for i, hop in enumerate(self.hops):
            nxt = self.hops[(i + 1) % k]
            # the hop dials only what the next hop's signed report binds: the newest one we hold
            msg = pb.LinkSignal(route_epoch=self.epoch, peer_id=nxt.span.peer_id, next_report=self._report_of(nxt),
                                session_id=nxt.stream.session_id, attach_token=nxt.attach_token,
                                forward_until=self._forward_until, stop_at_eog=self.stop_at_eog)
            try:
                # the peer dials within LINK_TIMEOUT_S: wait past that, so its verdict comes first
                hop.stream.signal(pb.SessionRequest(link=msg), self.epoch, timeout=self.step_timeout + LINK_TIMEOUT_S)
            except ShardError as e:
                if e.code_name == "CAPACITY":  # the next hop had no worker for the attach: busy, not faulty
                    return (i + 1) % k, e
                if e.code_name == "LINK_LIMITED":  # it makes no more links for us now: route around it, no ban
                    return i, e
                if e.code_name == "LINK_FAILED":  # it could not reach the next hop, or that one would not take
                    # the attach: if it takes one from this client, the fault is the linking hop's (its
                    # network, or a lie that would spend our failovers on its successors one after
                    # another); else the next hop's (dead, or one that answers everything but attaches)
                    return (i if self._takes_attach(nxt) else (i + 1) % k), e
                return i, e
            except ShardConnectionError as e:
                return i, e
        return None

    def _report_of(self, hop: _Hop) -> bytes:
        """The newest signed report of ``hop``'s peer this route holds (a long generation
        outlives the one it opened with: reports live minutes), surveyed afresh once if
        that one is about to expire."""
        def newest():  # a report saying it leaves is refused: its session still serves till it ends
            mine = [s.record for s in self.spans if s.peer_id == hop.span.peer_id and s.record is not None]
            return max([hop.span.record, *mine], key=lambda r: (not r.content.get("departing"), r.seq))
        record = newest()
        if record.expires_at_ms - wall_ms() < REPORT_MARGIN_MS:
            self.spans = self.spans_provider()
            record = newest()
        return record.wire

    def _takes_attach(self, hop: _Hop) -> bool:
        """Whether ``hop``'s session takes, from this client, the attach its previous hop was asked to make."""
        return hop.client.can_attach(hop.stream.session_id, hop.attach_token, self.epoch,
                                     min(self.step_timeout, CONNECT_TIMEOUT_S))

    def _ring_step(self, position: int, token_ids: tuple[int, ...], decode: bool):
        """One step of the ring: sent to the head unless the tail fed it already,
        then every hop's copy read in route order (each the next one's input,
        kept for failover). The first hop whose copy does not come is the one
        that failed: it is replaced, the others rolled back to ``position``."""
        for _ in range(self.max_failovers + 2):  # each pass either returns or spends a failover
            fault = None
            if self._ring_next != position:
                try:
                    self.hops[0].stream.send_step(position, token_ids=token_ids, decode=decode,
                                                  idempotency_step=position + 1)
                except ShardConnectionError as e:
                    fault = (0, e)
            if fault is None and self._ring_next == position and len(self.hops) > 1 \
                    and not self.hops[0].stream.readable(self.step_timeout / 2):
                # the head's copy of a step the tail was to feed is late: the missing part may be
                # the tail's forward (killed after its copy), not the head. Feed the head ourselves
                # (the same step number: it is taken once), so whoever then fails to answer is the
                # one blamed; waiting it out would cancel the head's stream and blame the head.
                try:
                    self.hops[0].stream.send_step(position, token_ids=token_ids, decode=decode,
                                                  idempotency_step=position + 1)
                except ShardConnectionError as e:
                    fault = (0, e)
            if fault is None:
                reply, fault = self._collect(position, token_ids, decode)
            if fault is None:
                nxt = position + 1
                self._ring_next = nxt if decode and nxt < self._forward_until and \
                    not (reply.is_eog and self.stop_at_eog) else None
                return reply
            self._ring_recover(position, fault)
        raise GenerationError(f"gave up after {self.max_failovers} failovers")

    def _collect(self, position: int, token_ids: tuple[int, ...], decode: bool):
        """Each hop's result for the step at ``position``: (the tail's reply, None),
        or (None, (index of the hop at fault, why))."""
        rows = 1 if decode else len(token_ids)
        payload: object = token_ids
        reply = None
        for i, hop in enumerate(self.hops):
            try:
                reply = hop.stream.next_result(self.epoch, timeout=self.step_timeout)
                if reply.position != position + rows:
                    raise ShardConnectionError(f"{hop.span.peer_id} sent the result of another step "
                                               f"(position {reply.position}, not {position + rows})")
                self._check_kind(hop, reply)
            except (ShardConnectionError, ShardError) as e:
                return None, (i, e)
            hop.history.append((position, payload, decode))  # what it computed: replayed on failover
            payload = reply.hidden
        return reply, None

    def _ring_recover(self, position: int, fault: tuple[int, MeshnetError] | None) -> None:
        """Replace the hop at fault (and any that fails meanwhile), roll the others
        back to ``position`` on a new route epoch, and link the ring again. Steps
        of the old route still on their way are refused (EPOCH_STALE) or passed over."""
        failed: set[int] = set()  # indices into self.hops still to replace (closed already)
        while fault is not None:
            index, error = fault
            self._fail(self.hops[index], error)
            failed.add(index)
            self.epoch += 1
            self._ring_next = None
            for hop in self.hops:  # what is past `position` is computed again, on the new route
                hop.history = [h for h in hop.history if h[0] < position]
            fault = self._rollback_others(failed, position) or self._replace_failed(failed) or self._link_ring()

    def _fail(self, hop: _Hop, error: MeshnetError) -> None:
        self.failovers += 1
        if self.failovers > self.max_failovers:
            raise GenerationError(f"gave up after {self.max_failovers} failovers; last: {error}")
        if not _is_full(error):
            self.banned[hop.span.peer_id] = time.monotonic() + self.ban_seconds
        self.on_event(f"peer {hop.span.peer_id} failed on layers {hop.span.start}-{hop.span.end - 1} "
                      f"({error}); rerouting the ring")
        hop.close()

    def _rollback_others(self, failed: set[int], position: int) -> tuple[int, MeshnetError] | None:
        for j, hop in enumerate(self.hops):
            if j in failed:
                continue
            hop.stream.route_epoch = self.epoch  # the client's own steps go out on the new route too
            token = os.urandom(ATTACH_TOKEN_BYTES)  # the failed hop knew the old secret of the hop after it
            try:
                hop.stream.signal(pb.SessionRequest(rollback=pb.RollbackSignal(
                    position=position, route_epoch=self.epoch, attach_token=token)), self.epoch,
                    timeout=self.step_timeout)
            except (ShardConnectionError, ShardError) as e:
                return j, e
            hop.attach_token = token
        return None

    def _replace_failed(self, failed: set[int]) -> tuple[int, MeshnetError] | None:
        """Open a replacement for each failed hop and replay its inputs (from the
        last, so earlier indices stay put when one span takes several hops)."""
        for index in sorted(failed, reverse=True):
            old = self.hops[index]
            self.spans = self.spans_provider()
            new_hops = self._open_chain(old.span.start, old.span.end)
            try:
                self._replay(old.history, new_hops)
            except (ShardConnectionError, ShardError) as e:  # a replacement failed too: another round
                for hop in new_hops:
                    if not _is_full(e):
                        self.banned[hop.span.peer_id] = time.monotonic() + self.ban_seconds
                    hop.close()
                return index, e  # the failed hop stays in its place, its history with it
            self.hops[index : index + 1] = new_hops
            failed.discard(index)
        return None

    def attestations(self) -> list[Attestation]:
        """Each hop's signed statement of what it computed, checked against what
        this client gave it and got back (raises CertificationError otherwise)."""
        if not self.attest:
            raise CertificationError("this route session was not opened to attest (attest=True)")
        out = []
        for hop in self.hops:
            m = hop.stream.attest(timeout=self.step_timeout)
            a = Attestation(m.peer_id, m.session_id, m.model_digest, m.recipe_digest, m.start, m.end, m.steps,
                            m.input_digest, m.output_digest, m.signature)
            seen = (hop.span.peer_id, hop.stream.session_id, hop.span.start, hop.span.end, hop.steps,
                    hop.inputs.hexdigest(), hop.outputs.hexdigest())
            if (a.peer_id, a.session_id, a.start, a.end, a.steps, a.input_digest, a.output_digest) != seen:
                raise CertificationError(f"{hop.span.peer_id} attests other work than this route gave it")
            if not a.verifies():
                raise CertificationError(f"{hop.span.peer_id}'s attestation signature does not verify")
            out.append(a)
        return out

    def route(self) -> list[dict]:
        return [{"peer_id": h.span.peer_id, "layers": [h.span.start, h.span.end]} for h in self.hops]

    def close(self) -> None:
        for hop in self.hops:
            try:
                hop.stream.release(timeout=self.step_timeout)  # a peer that froze must not hang us here
            except MeshnetError:
                pass
            hop.client.close()


def connect(span: Span, timeout: float, client_creds: TlsCredentials | None = None,
            pool: ChannelPool | None = None) -> ShardClient:
    """A data-plane client for the peer of ``span``: direct, or through the relay
    its report names, with TLS pinned to the certificate its signed report carries,
    presenting ``client_creds`` (default: this process's client certificate).
    With ``pool``, on a channel shared with other sessions to the same peer."""
    c = span.record.content
    cert = c.get("tls_cert", "").encode()
    peer = PeerId.from_string(c["peer_id"])
    if cert_identity(cert) != peer:  # a report cannot pass off another peer's certificate
        raise MeshnetError(f"the TLS certificate in {peer}'s report belongs to another peer")
    if c.get("relay"):
        relay = Multiaddr.parse(c["relay"])
        way = {"relay": (relay.host, relay.port)}
    else:
        addr = Multiaddr.parse(c["addrs"][0])
        if addr.peer_id != peer:
            raise MeshnetError(f"report of {peer} advertises an address of another peer")
        way = {"address": (addr.host, addr.port)}
    channel, release = lease_channel(pool, cert, peer_id=peer, client=client_creds, **way)
    return ShardClient(channel, timeout=timeout, release=release)


def _n_ubatch(report: dict, cap: pb.Capability) -> int:
    """The route's micro-batch size: from the report's axes (which hash to its
    recipe digest), else what the peer says; a peer cannot crash us with it."""
    value = (report.get("recipe") or {}).get("n_ubatch", cap.fingerprint.recipe_axes.get("n_ubatch"))
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if not 0 < n <= 1 << 16:
        raise MeshnetError(f"{report['peer_id']} states no usable n_ubatch ({str(value)[:20]!r})")
    return n


def _route_fingerprint(report: dict) -> pb.Fingerprint:
    """The fingerprint a route opens every hop with: its model and recipe, each axis spelled out."""
    return pb.Fingerprint(model_digest=report["model_digest"], recipe_digest=report["recipe_digest"],
                          recipe_axes={k: str(v) for k, v in (report.get("recipe") or {}).items()})


class Client:
    """Generates through the swarm, on recipes this client holds certified only.

    ``trust``: whose certificates count (default: the bootstrap peers' keys, and
    ``identity``'s if given, see :class:`TrustPolicy`)."""

    def __init__(self, bootstrap: Sequence[str | Multiaddr], *, model_path: str | None = None,
                 model_digest: str | None = None, step_timeout: float = 10.0, max_failovers: int = 4,
                 on_event: Callable[[str], None] | None = None, trust: TrustPolicy | None = None,
                 identity: Identity | None = None, ring: bool = True) -> None:
        from meshnet_p2p.engine.cut import inspect_gguf
        from meshnet_p2p.engine.tokenizer import Tokenizer
        from meshnet_p2p.engine.models import default_model_path

        self.bootstrap = list(bootstrap)
        path = model_path or default_model_path()
        info = inspect_gguf(path)  # hashes an uncut model; a shard carries its source's digest
        self.n_layer = info.source_layers
        self.model_digest = model_digest or info.model_digest
        self.tokenizer = Tokenizer(path)
        # the file name up to its first dot: "SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct"
        self.model_name = os.path.basename(path).split(".")[0] or self.model_digest
        self.step_timeout = step_timeout
        self.max_failovers = max_failovers
        self.on_event = on_event
        self.ring = ring  # peers forward hidden states to each other (docs/ring.md)
        self.pool = ChannelPool()  # one connection per peer for all of this client's generations
        self.trust = trust if trust is not None else TrustPolicy.default(self.bootstrap, own=identity)
        self.latency_ms: dict[str, float] = {}  # peer -> measured round trip, kept across generations
        self.measured_ms: dict[str, float] = {}  # peer -> measured ms per decode step, kept likewise
        # peers count this client's sessions under its identity (the process's own when none is given)
        self.client_creds = make_client_credentials(identity) if identity is not None else None
        self._survey_lock = threading.Lock()  # the last survey, shared by generations that start together
        self._survey: tuple[float, list[Span]] | None = None
        self._surveying: threading.Event | None = None
        self.stats = ClientStats()  # generations, tokens, failovers: read by the api role's metrics

    def close(self) -> None:
        """Close the connections this client keeps to peers (generations under way fail)."""
        self.pool.close()

    async def spans(self, *, max_age_s: float = 0.0) -> list[Span]:
        """The spans of the certified recipe a route is planned over (RecipeNotCertified if none).
        With ``max_age_s``, a survey that recent (or one under way) is shared: sixteen users
        starting at once make one survey, not sixteen bursts at the bootstrap peers."""
        while max_age_s > 0:
            with self._survey_lock:
                if self._survey is not None and time.monotonic() - self._survey[0] <= max_age_s:
                    return self._survey[1]
                under_way = self._surveying
                if under_way is None:
                    break
            await trio.to_thread.run_sync(under_way.wait)  # then look again (it may have failed: survey then)
        mine = threading.Event()
        with self._survey_lock:
            self._surveying = self._surveying or mine
        try:
            spans = routable_spans(await survey(self.bootstrap, self.model_digest, self.n_layer, self.trust), self.trust)
            with self._survey_lock:
                self._survey = (time.monotonic(), spans)
            return spans
        finally:
            with self._survey_lock:
                if self._surveying is mine:
                    self._surveying = None
            mine.set()

    def _provider(self, run) -> Callable[[], list[Span]]:
        """A route's spans: a recent survey at first, a fresh one each time it looks
        again (after failures, the swarm may have changed)."""
        looks = itertools.count()

        def provide() -> list[Span]:
            return run(functools.partial(self.spans, max_age_s=0.0 if next(looks) else SPANS_MAX_AGE_S))
        return provide

    def generate(self, prompt: str, max_tokens: int = 64, sampling: SamplingParams | None = None, *,
                 chat: bool = False, on_token: Callable[[str], None] | None = None, stop_at_eog: bool = True) -> GenerationResult:
        """From plain (non-trio) code."""
        return self._generate(self._provider(trio.run), prompt, max_tokens, sampling or SamplingParams(),
                              chat, on_token, stop_at_eog)

    async def agenerate(self, prompt: str, max_tokens: int = 64, sampling: SamplingParams | None = None, *,
                        chat: bool = False, on_token: Callable[[str], None] | None = None,
                        stop_at_eog: bool = True) -> GenerationResult:
        """From trio: the token loop runs in one worker thread (blocking gRPC), and
        route discovery comes back to this trio loop."""
        provider = self._provider(trio.from_thread.run)
        return await trio.to_thread.run_sync(self._generate, provider, prompt, max_tokens,
                                             sampling or SamplingParams(), chat, on_token, stop_at_eog)

    def _generate(self, *args) -> GenerationResult:
        try:
            result = self._run(*args)
        except Exception:
            self.stats.generations.add("failed")
            raise
        s = self.stats
        s.generations.add("completed")
        s.tokens.add("prompt", result.prompt_tokens)
        s.tokens.add("generated", len(result.token_ids))
        s.first_token_seconds.observe(result.ttft_ms / 1000)
        return result

    def _run(self, provider, prompt, max_tokens, sampling, chat, on_token, stop_at_eog) -> GenerationResult:
        text = self.tokenizer.chat_prompt(prompt) if chat else prompt
        ids = self.tokenizer.encode(text)
        if not ids:
            raise GenerationError("the prompt is empty")
        try:
            session = RouteSession(provider, self.n_layer, max_tokens=len(ids) + max_tokens, sampling=sampling,
                                   step_timeout=self.step_timeout, max_failovers=self.max_failovers,
                                   on_event=self.on_event, latency_ms=self.latency_ms, measured_ms=self.measured_ms,
                                   client_creds=self.client_creds, ring=self.ring, stop_at_eog=stop_at_eog,
                                   pool=self.pool)
        except RequestRefused as e:  # say what was asked, beside what the peers said they hold
            raise RequestRefused(f"the prompt has {len(ids)} tokens and max_tokens asks for {max_tokens} more "
                                 f"({len(ids) + max_tokens} positions in all): {e}") from None
        decoder = self.tokenizer.stream_decoder()
        try:
            run = generate(session, ids, max_tokens, stop_at_eog=stop_at_eog,
                           on_token=(lambda tok: on_token(decoder.feed(tok))) if on_token else None)
            if on_token:
                on_token(decoder.flush())
            return GenerationResult(prompt_tokens=len(ids), token_ids=run.token_ids, ttft_ms=run.ttft_ms,
                                    decode_ms=run.decode_ms, stopped=run.stopped, steps=run.steps,
                                    text=self.tokenizer.decode(run.token_ids),
                                    route=session.route(), failovers=session.failovers)
        finally:
            self.stats.failovers.add("failovers", session.failovers)  # a failed generation's too
            session.close()
