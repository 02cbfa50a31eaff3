"""The ShardRuntime gRPC servicer: the Session stream in front of a ShardEngine.

It fails closed, with a typed error, on: a fingerprint that does not match
(naming every mismatching recipe axis), a stale route epoch, an expired
deadline, fragments that do not tile or fail their CRC32C, exhausted
flow-control credit (topped up in-band), a repeated idempotency step (acked,
never applied twice), cancels in-band and out-of-band (also one that arrives
before its session opens), oversized messages and sessions beyond capacity.
Errors are per session: nothing one stream does reaches another's state.
When the peer is full, sessions are shared fairly between source addresses
and client identities (admission.py); a session reclaimed for that, or
released for idling, fails closed on its next request, saying why.

It registers its methods on the generic gRPC server (transport/server.py),
decoding requests and encoding replies through wire.py; the server tells each
call who makes it (a ``Caller``), and this service keeps which connection owns
which session itself. What a step does to a session: steps.py; a session's
seat in a ring and its links to the next hop: ring_links.py.

The server runs each stream on a thread of its pool, which reads the stream's
requests in order. An in-band cancel therefore acts between steps (later
steps of the cancelled work or session fail closed); the unary Cancel RPC,
served on another thread, reaches a step while it runs and aborts it in the
engine. (A second reader thread per stream would let in-band cancels do that
too, at ~50-100 us per step; the out-of-band path keeps the hot path lean.)
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Iterator

from meshnet_p2p.engine.contract import OpenRequest, ShardEngine, check_session_id
from meshnet_p2p.engine.keepwarm import KeepWarm
from meshnet_p2p.engine.recipe import explain_mismatch
from meshnet_p2p.engine.sessions import context_refusal
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.core.records import wall_ms
from meshnet_p2p.core.stats import ServingStats
from meshnet_p2p.dataplane.transport import grpc_core
from meshnet_p2p.dataplane.transport.server import BIDI, UNARY, Abort, Caller, Method, Server
from .admission import Claimant, Held, Reclaim, Refuse, decide
from .link_guard import LinkBounds
from .ring import ATTACH_TOKEN_BYTES, LINK_DIAL_S, LINK_TIMEOUT_S, token_matches
from .ring_links import FULL_RETRY_AFTER_MS, RingLinks, RingSeat
from .session_state import SessionState
from .steps import ENGINE_CODES, Steps
from . import wire
from .wire import ErrorCode as E, reply_error as _error


@dataclass(frozen=True)
class Limits:
    max_credits: int = 64
    max_message_bytes: int = 16 << 20
    max_prefill_tokens: int = 4096
    max_pending_cancels: int = 4096  # cancels remembered for sessions not open yet
    session_idle_ms: int = 120_000  # an open session with no request for this long is released
    link_dial_ms: int = int(LINK_DIAL_S * 1000)  # a ring link's TCP + TLS to the next hop
    link_answer_ms: int = int(LINK_TIMEOUT_S * 1000)  # a link that failed before that is answered no earlier
    links: LinkBounds = LinkBounds()  # ring links per client and per peer over time, and the backoff of a failed target
    # after each step, keep this many CPUs awake (idle priority) this long, so the session's
    # next step does not wake them from sleep (engine/keepwarm.py); 0: off, as in-process
    keep_warm_ms: int = 0
    keep_warm_threads: int = 1


IN_PROCESS = Claimant("in-process", "in-process")  # a caller with no connection (tests, embedding)
_STRANGER = Claimant("\x00a new address", "\x00a new client")  # what a newcomer could get (free_sessions)


@dataclass
class _Session(SessionState):
    """A session's protocol state (session_state.py) and what this service keeps beside it."""

    # Who may cancel or release it: the connection that opened it (or, for a cancel that
    # came first, the connection that sent it): Caller.connection; None: in-process.
    owner: int | None = None
    claimant: Claimant | None = None  # whose share it counts in, once admitted (admission.py)
    ring: RingSeat | None = None  # its seat in a ring: its attach token, its link (ring_links.py)


def _owner(caller: Caller | None) -> int | None:
    return None if caller is None else caller.connection


def _claimant(caller: Caller | None) -> Claimant:
    return IN_PROCESS if caller is None else Claimant(caller.host_group, caller.peer_id)


def _unlink(state: _Session | None) -> None:
    if state is not None and state.ring is not None:
        state.ring.unlink()


class ShardRuntimeServicer:
    """The service's methods, on decoded requests; ``caller``: who calls, as the
    server proved it (None: in-process). ``register`` serves them on a Server."""

    def __init__(self, engine: ShardEngine, *, peer_id: str = "", limits: Limits = Limits(),
                 now_ms=wall_ms, on_open=None, identity: Identity | None = None) -> None:
        self.engine = engine
        self.identity = identity  # signs attestations of what a session computed
        peer_id = str(identity.peer_id) if identity is not None else peer_id
        self.on_open = on_open  # called with each newly opened session id
        self.draining = False  # set on shutdown: open sessions finish, new ones are refused
        self.peer_id = peer_id
        self.limits = limits
        self.now_ms = now_ms
        caps = engine.capabilities()
        if caps is None:
            raise ValueError("the engine must be loaded before it is served")
        self.caps = caps
        self.fingerprint = wire.served_fingerprint(caps.model_digest, caps.recipe_digest, caps.recipe)
        self._layers = wire.layer_range(caps.start, caps.end, caps.source_layers)
        self._lock = threading.Lock()
        self._states: dict[str, _Session] = {}
        # sessions released for idling or reclaimed for a fair share (the newest 4096): why, as an error
        self._reaped: dict = {}
        self.stats = ServingStats()  # read by the role's metrics (metrics.py)
        self.links = RingLinks(caps=caps, limits=limits, stats=self.stats, now_ms=now_ms, identity=identity)
        self.keep_warm = KeepWarm(limits.keep_warm_threads, limits.keep_warm_ms / 1000)
        self.steps = Steps(engine, caps=caps, limits=limits, stats=self.stats, now_ms=now_ms, identity=identity,
                           peer_id=peer_id, keep_warm=self.keep_warm)

    def close(self) -> None:
        """Close the ring's connections to next hops (the server has stopped)."""
        self.links.close()

    # --- on the wire ---------------------------------------------------------------

    def methods(self) -> dict[str, Method]:
        """The method table a Server serves: each decodes its request through wire.py,
        calls the method below with the server's Caller, and encodes the reply."""
        def unary(name: str):
            method = getattr(self, name)

            def handle(raw: bytes, caller: Caller) -> bytes:
                return wire.encode(method(_decoded(name, raw), caller))
            return Method(UNARY, handle)

        def session(raws, caller: Caller, send) -> Iterator[bytes]:
            requests = (_decoded("Session", raw) for raw in raws)
            for reply in self.Session(requests, caller, push=lambda r: send(wire.encode(r))):
                yield wire.encode(reply)

        table = {wire.method_path(name): unary(name) for name in ("GetCapability", "Health", "Cancel", "Release")}
        table[wire.method_path("Session")] = Method(BIDI, session)
        return table

    def register(self, server: Server) -> Server:
        """Serve this service on ``server``; its ring links close when the server stops."""
        return server.register(self.methods(), on_stop=self.close)

    # --- unary ---------------------------------------------------------------------

    def GetCapability(self, request, caller: Caller | None):
        c = self.caps
        return wire.capability_reply(
            peer_id=self.peer_id, fingerprint=self.fingerprint,
            layers=self._layers,
            max_sessions=c.max_sessions, free_sessions=self.open_to_newcomers(),
            kv_token_budget=c.kv_token_budget, flow_control=self._limits_proto(),
            n_embd=c.n_embd, seam_dtype=str(c.recipe["seam_dtype"]),
        )

    def Health(self, request, caller: Caller | None):
        h = self.engine.health()
        return wire.health_reply(h.serving, h.state, h.active_sessions, h.detail)

    def Cancel(self, request, caller: Caller | None):
        newly = self._cancel(request.session_id, request.work_id, owner=_owner(caller))
        return wire.cancel_reply(newly)

    def Release(self, request, caller: Caller | None):
        with self._lock:  # only the connection that opened a session may release it
            state = self._states.get(request.session_id)
            if state is None or not state.opened or state.owner != _owner(caller):
                return wire.release_reply(False)
            self._states.pop(request.session_id, None)
        _unlink(state)  # outside the lock: closing a link writes to the next hop
        self.engine.release(request.session_id)
        return wire.release_reply(True)

    def _limits_proto(self):
        lim = self.limits
        return wire.flow_control(lim.max_credits, lim.max_message_bytes, lim.max_prefill_tokens)

    def _state(self, session_id: str) -> _Session | None:
        with self._lock:
            return self._states.get(session_id)

    def _cancel(self, session_id: str, work_id: str, owner: int | None = None) -> bool:
        """Mark cancelled (creating the state if the session is not open yet) and
        abort the engine's in-flight step for it. Only the connection that opened
        the session (or sent the first cancel) reaches it: a stranger who learns a
        session ID cannot cancel another client's work."""
        with self._lock:
            state = self._states.get(session_id)
            if state is None:
                if len(self._states) >= self.limits.max_pending_cancels or not session_id:
                    return False
                state = self._states[session_id] = _Session(session_id, owner=owner)
            elif state.owner != owner:
                return False
            newly = state.cancel(work_id)
            opened = state.opened
            running = state.running
        if opened and not work_id:
            self.engine.cancel(session_id)  # ends the session, aborting any running step
        elif opened and running == work_id:
            self.engine.cancel(session_id, keep_session=True)  # aborts only that step
        return newly

    # --- the Session stream ----------------------------------------------------------------

    def Session(self, request_iterator, caller: Caller | None, push=None) -> Iterator:
        """``push``: sends this stream a message from another thread (the ring's
        copies); a host without one serves no ring."""
        opened_id = None
        opened = None  # its state: still ours to unlink when the state was dropped meanwhile
        try:
            for req in request_iterator:
                kind = req.WhichOneof("kind")
                if req.ByteSize() > self.limits.max_message_bytes:
                    yield _error(E.OVERSIZED, f"message of {req.ByteSize()} bytes exceeds {self.limits.max_message_bytes}")
                    continue
                if kind == "attach" and opened_id is None:  # this stream feeds a session open on another
                    yield from self._attached(req.attach, request_iterator, None if caller is None else caller.peer_id)
                    return
                if kind == "open":
                    if opened_id is not None:
                        yield _error(E.PROTOCOL, "the session is already open on this stream")
                        continue
                    reply, opened_id = self._open(req.open, caller, push)
                    opened = self._state(opened_id) if opened_id is not None else None
                    if opened_id is None and reply.HasField("error"):
                        self.stats.refused.add(E.Name(reply.error.code))
                    yield reply
                    if opened_id is None:
                        return
                    continue
                if opened_id is None:
                    yield _error(E.PROTOCOL, f"{kind or 'empty message'} before SessionOpen", terminal=True)
                    return
                state = self._state(opened_id)
                if state is None:
                    yield self._reaped.get(opened_id) or _error(
                        E.UNKNOWN_SESSION, "the session was released out of band", terminal=True)
                    return
                state.last_active_ms = self.now_ms()
                if kind == "step":
                    t0 = time.perf_counter()
                    reply = self.steps.step(opened_id, state, req.step)
                    yield reply
                    if reply.HasField("result"):  # resumed once the server has written the reply
                        self.stats.step_seconds["total"].observe(time.perf_counter() - t0)
                elif kind == "credit":
                    state.top_up(req.credit.credits)
                elif kind == "cancel":
                    self._cancel(opened_id, req.cancel.work_id, owner=_owner(caller))
                    whole = not req.cancel.work_id
                    yield _error(E.CANCELLED, req.cancel.reason or "cancelled", work_id=req.cancel.work_id, terminal=whole)
                    if whole:
                        return
                elif kind == "rollback":
                    yield self.steps.rollback(opened_id, state, req.rollback)
                elif kind == "attest":
                    yield self.steps.attest(opened_id, state)
                elif kind == "link":
                    yield self.links.link(state, state.claimant or IN_PROCESS, req.link)
                elif kind == "release":
                    if self._forget(opened_id, opened):  # before the reply: the client may open another at once
                        self.engine.release(opened_id)
                    yield wire.reply_released(opened_id)
                    return
                else:
                    yield _error(E.PROTOCOL, "unknown message", terminal=True)
                    return
        finally:
            if opened_id is not None:
                if opened is not None and opened.ring is not None:
                    opened.ring.unlink()
                # Admission forgets it before the engine frees it, as Release and the
                # reaper do: whoever sees the engine's count drop may open at once. A
                # state already dropped (released, reaped, reclaimed) was freed by its dropper.
                if opened is not None and self._forget(opened_id, opened):
                    self.engine.release(opened_id)  # the client went away: free its capacity

    def _open(self, msg, caller: Caller | None = None, push=None) -> tuple[object, str | None]:
        sid = msg.session_id
        try:
            check_session_id(sid)
        except ValueError as e:
            return _error(E.INVALID_ARGUMENT, str(e), terminal=True), None
        if len(msg.attach_token) > ATTACH_TOKEN_BYTES:
            return _error(E.INVALID_ARGUMENT, f"an attach token is at most {ATTACH_TOKEN_BYTES} bytes",
                          terminal=True), None
        if self.draining:
            return _error(E.CAPACITY, "this peer is leaving the network", retryable=True, terminal=True), None
        theirs = msg.fingerprint
        if (theirs.model_digest, theirs.recipe_digest) != (self.fingerprint.model_digest, self.fingerprint.recipe_digest):
            reasons = []
            if theirs.model_digest != self.fingerprint.model_digest:
                reasons.append(f"model_digest is {theirs.model_digest[:16]!r}... there, {self.fingerprint.model_digest[:16]!r}... here")
            reasons += explain_mismatch(dict(self.fingerprint.recipe_axes), dict(theirs.recipe_axes))
            if not reasons:
                reasons.append("recipe_digest differs on an axis this peer does not know")
            return _error(E.FINGERPRINT_MISMATCH, "; ".join(reasons), terminal=True, mismatches=reasons), None
        too_long = context_refusal(msg.max_tokens, self.caps.n_ctx_per_session)
        if too_long is not None:  # the request's own error comes before "busy", which a client would wait out
            return _error(ENGINE_CODES[too_long.code], too_long.message, terminal=True), None
        who, owner = _claimant(caller), _owner(caller)
        reclaim = None
        with self._lock:
            state = self._states.get(sid)
            if state is not None and state.opened:
                return _error(E.INVALID_ARGUMENT, f"session {sid!r} is already open", terminal=True), None
            if state is not None and state.owner != owner:  # a stranger's early cancel: not ours
                state = None
            if state is not None and state.cancelled:
                self._states.pop(sid, None)
                return _error(E.CANCELLED, "the session was cancelled before it opened", terminal=True), None
            decision = self._admission(who)
            if isinstance(decision, Refuse):  # refused: the early cancel (if any) stays
                return _error(E.CAPACITY, decision.reason, retryable=True, terminal=True,
                              retry_after_ms=FULL_RETRY_AFTER_MS), None
            if isinstance(decision, Reclaim):
                self.stats.sessions.add("reclaimed")
                reclaim = decision.session_id
                reclaimed = self._states.pop(reclaim, None)
                self._remember_reaped(reclaim, _error(
                    E.CAPACITY, "the session was reclaimed: this peer is full and shares its sessions fairly "
                    "between clients", retryable=True, terminal=True))
            if state is None:
                state = self._states[sid] = _Session(sid, owner=owner)
            state.claimant = who
            state.last_active_ms = self.now_ms()  # admitted now: not idle, whatever a cancel before it did
        if reclaim is not None:
            _unlink(reclaimed)
            self.engine.release(reclaim)  # aborts a step it may be running
        if msg.max_tokens <= 0:  # the KV positions to reserve: zero would be a session that can do nothing
            self._forget(sid)
            return _error(E.INVALID_ARGUMENT, f"max_tokens must be positive, not {msg.max_tokens}", terminal=True), None
        try:
            sampling = wire.sampling_from_proto(msg.sampling)
            status = self.engine.open_session(OpenRequest(sid, msg.max_tokens, sampling))
        except ValueError as e:
            self._forget(sid)
            return _error(E.INVALID_ARGUMENT, str(e), terminal=True), None
        if not status.ok:
            self._forget(sid)
            return _error(ENGINE_CODES[status.code], status.message, retryable=status.retryable, terminal=True,
                          retry_after_ms=FULL_RETRY_AFTER_MS if status.retryable else 0), None
        credits = min(msg.proposed.credits or self.limits.max_credits, self.limits.max_credits)
        state.ring = RingSeat(attach_token=msg.attach_token, push=push)
        state.open(msg.route_epoch, credits)
        state.last_active_ms = self.now_ms()
        self.stats.sessions.add("opened")
        if self.on_open is not None:
            self.on_open(sid)
        granted = self._limits_proto()
        granted.credits = credits
        return wire.reply_accepted(sid, msg.route_epoch, granted, self._layers), sid

    def _admission(self, who: Claimant):
        now = self.now_ms()
        held = [Held(sid, st.claimant, now - st.last_active_ms, st.running is not None)
                for sid, st in self._states.items() if st.claimant is not None]
        return decide(held, who, capacity=self.caps.max_sessions)

    def open_to_newcomers(self) -> int:
        """Sessions a client new to this peer could get now: the free ones, or one
        reclaimed from a group above its share. What the peer advertises, so a
        peer that one client fills does not drop out of everyone's routes."""
        if self.draining:
            return 0
        free = self.caps.max_sessions - self.engine.metrics().active_sessions
        if free > 0:
            return free
        with self._lock:
            return 1 if isinstance(self._admission(_STRANGER), Reclaim) else 0

    def _remember_reaped(self, sid: str, why) -> None:
        self._reaped[sid] = why
        while len(self._reaped) > 4096:
            self._reaped.pop(next(iter(self._reaped)))

    def reap_idle(self, idle_ms: int | None = None) -> list[str]:
        """Release every open session that has sent nothing for ``idle_ms``
        (default ``session_idle_ms``) and is not computing: an idle session must
        not hold capacity forever. Its stream then fails closed, saying why.
        Returns the released IDs."""
        now = self.now_ms()
        bound = self.limits.session_idle_ms if idle_ms is None else idle_ms
        with self._lock:
            idle = [sid for sid, st in self._states.items()
                    if st.opened and st.running is None and now - st.last_active_ms > bound]
            gone = [self._states.pop(sid) for sid in idle]
            for sid in idle:
                self._remember_reaped(sid, _error(
                    E.UNKNOWN_SESSION, f"the session was released after {bound / 1000:g} s idle",
                    terminal=True))
        for state in gone:
            _unlink(state)
        for sid in idle:
            self.engine.release(sid)
        if idle:
            self.stats.sessions.add("released_idle", len(idle))
        return idle

    def _forget(self, sid: str, state: "_Session | None" = None) -> bool:
        """Drop a session's state; given ``state``, only that one (a session of the same
        ID opened since, by a client that saw this one released, is not this stream's).
        Whether it was there to drop: whoever drops a state frees its engine session."""
        with self._lock:
            if state is not None and self._states.get(sid) is not state:
                return False
            return self._states.pop(sid, None) is not None

    # --- the ring ----------------------------------------------------------------------------

    def _attached(self, msg, request_iterator, feeder: str | None) -> Iterator:
        """A stream that feeds an open session: steps only (and credit), answered only when they fail.
        ``feeder``: the peer its TLS proved (its steps come with that peer's signed commitments)."""
        sid = msg.session_id
        state = self._state(sid)
        if state is None or not state.opened or state.ring is None or \
                not token_matches(state.ring.attach_token, msg.attach_token):
            # one answer for a wrong token and an unknown session: it tells a stranger nothing
            yield _error(E.UNKNOWN_SESSION, "no session here takes this attach", terminal=True)
            return
        if msg.route_epoch != state.epoch:  # only the current route's previous hop (an older one is stale,
            # and a newer one no client has announced: it would shut the real route out)
            yield _error(E.EPOCH_STALE, "attach refused: it is not this route's epoch", terminal=True)
            return
        epoch = msg.route_epoch
        state.top_up(state.max_credits)  # a new feeder counts its credit from the grant: give back what the last spent
        granted = self._limits_proto()
        granted.credits = state.max_credits
        yield wire.reply_accepted(sid, msg.route_epoch, granted, self._layers)
        for req in request_iterator:
            kind = req.WhichOneof("kind")
            if req.ByteSize() > self.limits.max_message_bytes:
                yield _error(E.OVERSIZED, f"message of {req.ByteSize()} bytes exceeds {self.limits.max_message_bytes}")
                continue
            if self._state(sid) is not state:  # released or reclaimed meanwhile
                yield self._reaped.get(sid) or _error(E.UNKNOWN_SESSION, "the session has ended", terminal=True)
                return
            state.last_active_ms = self.now_ms()
            if kind == "step":
                if req.step.route_epoch != epoch:  # an attach stream feeds the route it attached for, only
                    yield _error(E.EPOCH_STALE, "a step of another route than this attach's", terminal=True)
                    return
                t0 = time.perf_counter()
                reply = self.steps.step(sid, state, req.step, attached=True, feeder=feeder)
                if reply is None:  # computed: the owner has its copy and the next hop its input
                    self.stats.step_seconds["total"].observe(time.perf_counter() - t0)
                else:
                    yield reply
            elif kind == "credit":
                state.top_up(req.credit.credits)
            else:
                yield _error(E.PROTOCOL, f"an attach stream carries steps, not {kind or 'an empty message'}",
                             terminal=True)
                return

def _decoded(method: str, raw: bytes):
    try:
        return wire.decode_request(method, raw)
    except ValueError as e:  # the call ends; the connection and every other call go on
        raise Abort(grpc_core.INTERNAL, str(e)) from None
