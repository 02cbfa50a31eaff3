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

The server (server.py) runs each stream on a thread of its pool, which reads
the stream's requests in order. An in-band cancel therefore acts between steps (later
steps of the cancelled work or session fail closed); the unary Cancel RPC,
served on another thread, reaches a step while it runs and aborts it in the
engine. (A second reader thread per stream would let in-band cancels do that
too, at ~50-100 us per step; the out-of-band path keeps the hot path lean.)
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from meshnet_p2p._proto import shard_runtime_pb2 as pb
from meshnet_p2p.engine.contract import (
    DecodeRequest,
    OpenRequest,
    PrefillRequest,
    SamplingParams,
    ShardEngine,
    StatusCode,
    check_session_id,
)
from meshnet_p2p.trust.attestation import Attestation
from meshnet_p2p.engine.recipe import explain_mismatch
from meshnet_p2p.engine.sessions import context_refusal
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.core.records import wall_ms
from meshnet_p2p.core.stats import ServingStats
from .admission import Claimant, Held, Reclaim, Refuse, decide
from meshnet_p2p.dataplane.transport.pool import ChannelPool
from .link_guard import LinkBounds, LinkGuard
from .ring import (ATTACH_TOKEN_BYTES, LINK_DIAL_S, LINK_TIMEOUT_S, MAX_LINKS_PER_SESSION, UNREACHED, LinkError,
                   ReportRefused, RingLink, forwards, next_hop, token_matches)
from .session_state import SessionState, Verdict
from .wire import PayloadError, bundle_from_proto, bundle_to_proto
from meshnet_p2p.dataplane.transport.tls import make_client_credentials

E = pb.ErrorCode

_ENGINE_CODES = {
    StatusCode.NOT_LOADED: E.INTERNAL,
    StatusCode.LOAD_FAILED: E.INTERNAL,
    StatusCode.INVALID_ARGUMENT: E.INVALID_ARGUMENT,
    StatusCode.UNKNOWN_SESSION: E.UNKNOWN_SESSION,
    StatusCode.SESSION_EXISTS: E.INVALID_ARGUMENT,
    StatusCode.CAPACITY_EXHAUSTED: E.CAPACITY,
    StatusCode.CONTEXT_EXHAUSTED: E.CONTEXT_EXHAUSTED,
    StatusCode.POSITION_MISMATCH: E.POSITION_MISMATCH,
    StatusCode.BAD_TENSOR: E.BAD_TENSOR,
    StatusCode.WRONG_INPUT: E.WRONG_INPUT,
    StatusCode.CANCELLED: E.CANCELLED,
    StatusCode.INTERNAL: E.INTERNAL,
}

_VERDICT_ERRORS = {
    Verdict.CANCELLED: (E.CANCELLED, "work was cancelled", False),
    Verdict.EPOCH_STALE: (E.EPOCH_STALE, "step carries a stale route epoch", False),
    Verdict.DEADLINE: (E.DEADLINE_EXCEEDED, "the step's deadline has passed", False),
    Verdict.NO_CREDIT: (E.FLOW_CONTROL, "no flow-control credit left; top up in-band", True),
    Verdict.NOT_OPEN: (E.PROTOCOL, "step before SessionOpen", False),
}


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


@dataclass
class _Ring:
    """A session's part in a ring (docs/ring.md): who may feed it, where its output goes."""

    attach_token: bytes = b""
    push: Callable[[pb.SessionResponse], None] | None = None  # sends the owner's stream a message
    link: RingLink | None = None
    links: int = 0
    # One step (or rollback) of the session at a time, whichever stream it came on: a rollback
    # to a newer route must not slip between an older step's epoch check and its compute.
    lock: threading.Lock = field(default_factory=threading.Lock)
    _swap: threading.Lock = field(default_factory=threading.Lock)  # (unlink comes from any thread)

    def unlink(self) -> None:
        with self._swap:
            link, self.link = self.link, None
        if link is not None:
            link.close()

    def relink(self, link: RingLink) -> None:
        with self._swap:
            old, self.link = self.link, link
        if old is not None:
            old.close()


def _unlink(state: SessionState | None) -> None:
    if state is not None and state.ring is not None:
        state.ring.unlink()


IN_PROCESS = Claimant("in-process", "in-process")  # a caller with no connection (tests, embedding)
_STRANGER = Claimant("\x00a new address", "\x00a new client")  # what a newcomer could get (free_sessions)


def _error(code: int, detail: str, *, work_id: str = "", step: int = 0, retryable: bool = False,
           terminal: bool = False, mismatches: list[str] | None = None, retry_after_ms: int = 0) -> pb.SessionResponse:
    return pb.SessionResponse(error=pb.Error(code=code, detail=detail, retryable=retryable, work_id=work_id,
                                             idempotency_step=step, terminal=terminal, mismatches=mismatches or [],
                                             retry_after_ms=retry_after_ms))


# A full peer's hint to ask again: sessions end as generations finish, seconds apart
# under load. The client backs off from it (and may go elsewhere meanwhile).
FULL_RETRY_AFTER_MS = 1000
DIAL_CERT_RENEW_S = 12 * 3600  # the ring's dials present a client certificate this young at most (it lasts 24 h)


class ShardRuntimeServicer:
    """The service's methods; ``server.py`` calls them with decoded requests (the
    ``context`` argument is unused, kept so grpcio's generated server could host it)."""

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
        self.fingerprint = pb.Fingerprint(
            model_digest=caps.model_digest, recipe_digest=caps.recipe_digest,
            recipe_axes={k: str(v) for k, v in caps.recipe.items()},
        )
        self._layers = pb.LayerRange(start=caps.start, end=caps.end, total=caps.source_layers)
        self._lock = threading.Lock()
        self._states: dict[str, SessionState] = {}
        # sessions released for idling or reclaimed for a fair share (the newest 4096): why, as an error
        self._reaped: dict[str, pb.SessionResponse] = {}
        self._link_pool = ChannelPool()  # the ring's connections to next hops, shared by sessions
        self._link_guard = LinkGuard(limits.links)  # how often links dial, and what they leave alone
        self._guard_lock = threading.Lock()
        self._dialling: dict[object, threading.Event] = {}  # targets a link is dialling now: others wait for it
        self._client_creds: tuple[float, object] = (0.0, None)  # (made at, the certificate the ring dials with)
        self.stats = ServingStats()  # read by the role's metrics (metrics.py)

    def close(self) -> None:
        """Close the ring's connections to next hops (the server has stopped)."""
        self._link_pool.close()

    # --- unary ---------------------------------------------------------------------

    def GetCapability(self, request, context):
        c = self.caps
        return pb.Capability(
            peer_id=self.peer_id, fingerprint=self.fingerprint,
            layers=self._layers,
            max_sessions=c.max_sessions, free_sessions=self.open_to_newcomers(),
            kv_token_budget=c.kv_token_budget, flow_control=self._limits_proto(),
            n_embd=c.n_embd, seam_dtype=str(c.recipe["seam_dtype"]),
        )

    def Health(self, request, context):
        h = self.engine.health()
        return pb.HealthReport(serving=h.serving, state=h.state, active_sessions=h.active_sessions, detail=h.detail)

    def Cancel(self, request, context):
        newly = self._cancel(request.session_id, request.work_id, owner=context)
        return pb.CancelResponse(cancelled=newly)

    def Release(self, request, context):
        with self._lock:  # only the connection that opened a session may release it
            state = self._states.get(request.session_id)
            if state is None or not state.opened or state.owner is not context:
                return pb.ReleaseResponse(released=False)
            self._states.pop(request.session_id, None)
        _unlink(state)  # outside the lock: closing a link writes to the next hop
        self.engine.release(request.session_id)
        return pb.ReleaseResponse(released=True)

    def _limits_proto(self) -> pb.FlowControl:
        lim = self.limits
        return pb.FlowControl(credits=lim.max_credits, max_message_bytes=lim.max_message_bytes,
                              max_prefill_tokens=lim.max_prefill_tokens)

    def _state(self, session_id: str) -> SessionState | None:
        with self._lock:
            return self._states.get(session_id)

    def _cancel(self, session_id: str, work_id: str, owner: object = None) -> bool:
        """Mark cancelled (creating the state if the session is not open yet) and
        abort the engine's in-flight step for it. Only the connection that opened
        the session (or sent the first cancel) reaches it: a stranger who learns a
        session ID cannot cancel another client's work."""
        with self._lock:
            state = self._states.get(session_id)
            if state is None:
                if len(self._states) >= self.limits.max_pending_cancels or not session_id:
                    return False
                state = self._states[session_id] = SessionState(session_id, owner=owner)
            elif state.owner is not owner:
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

    def Session(self, request_iterator, context, push=None) -> Iterator[pb.SessionResponse]:
        """``push``: sends this stream a message from another thread (the ring's
        copies); a host without one serves no ring."""
        opened_id = None
        opened = None  # its state: still ours to unlink when the state was dropped meanwhile
        released = False
        try:
            for req in request_iterator:
                kind = req.WhichOneof("kind")
                if req.ByteSize() > self.limits.max_message_bytes:
                    yield _error(E.OVERSIZED, f"message of {req.ByteSize()} bytes exceeds {self.limits.max_message_bytes}")
                    continue
                if kind == "attach" and opened_id is None:  # this stream feeds a session open on another
                    yield from self._attached(req.attach, request_iterator)
                    return
                if kind == "open":
                    if opened_id is not None:
                        yield _error(E.PROTOCOL, "the session is already open on this stream")
                        continue
                    reply, opened_id = self._open(req.open, context, push)
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
                    reply = self._step(opened_id, state, req.step)
                    yield reply
                    if reply.HasField("result"):  # resumed once the server has written the reply
                        self.stats.step_seconds["total"].observe(time.perf_counter() - t0)
                elif kind == "credit":
                    state.top_up(req.credit.credits)
                elif kind == "cancel":
                    self._cancel(opened_id, req.cancel.work_id, owner=context)
                    whole = not req.cancel.work_id
                    yield _error(E.CANCELLED, req.cancel.reason or "cancelled", work_id=req.cancel.work_id, terminal=whole)
                    if whole:
                        return
                elif kind == "rollback":
                    yield self._rollback(opened_id, state, req.rollback)
                elif kind == "attest":
                    yield self._attest(opened_id, state)
                elif kind == "link":
                    yield self._link(state, req.link)
                elif kind == "release":
                    self.engine.release(opened_id)
                    released = True
                    yield pb.SessionResponse(released=pb.Released(session_id=opened_id))
                    return
                else:
                    yield _error(E.PROTOCOL, "unknown message", terminal=True)
                    return
        finally:
            if opened_id is not None:
                if opened is not None and opened.ring is not None:
                    opened.ring.unlink()
                if not released:
                    self.engine.release(opened_id)  # the client went away: free its capacity
                self._forget(opened_id)

    def _open(self, msg: pb.SessionOpen, owner: object = None, push=None) -> tuple[pb.SessionResponse, str | None]:
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
            return _error(_ENGINE_CODES[too_long.code], too_long.message, terminal=True), None
        who = getattr(owner, "claimant", None) or IN_PROCESS
        reclaim = None
        with self._lock:
            state = self._states.get(sid)
            if state is not None and state.opened:
                return _error(E.INVALID_ARGUMENT, f"session {sid!r} is already open", terminal=True), None
            if state is not None and state.owner is not owner:  # a stranger's early cancel: not ours
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
                state = self._states[sid] = SessionState(sid, owner=owner)
            state.claimant = who
            state.last_active_ms = self.now_ms()  # admitted now: not idle, whatever a cancel before it did
        if reclaim is not None:
            _unlink(reclaimed)
            self.engine.release(reclaim)  # aborts a step it may be running
        if msg.max_tokens <= 0:  # the KV positions to reserve: zero would be a session that can do nothing
            self._forget(sid)
            return _error(E.INVALID_ARGUMENT, f"max_tokens must be positive, not {msg.max_tokens}", terminal=True), None
        sampling_msg = msg.sampling
        try:
            sampling = SamplingParams(
                temperature=sampling_msg.temperature, top_k=sampling_msg.top_k,
                top_p=sampling_msg.top_p or 1.0, seed=sampling_msg.seed,
            )
            status = self.engine.open_session(OpenRequest(sid, msg.max_tokens, sampling))
        except ValueError as e:
            self._forget(sid)
            return _error(E.INVALID_ARGUMENT, str(e), terminal=True), None
        if not status.ok:
            self._forget(sid)
            return _error(_ENGINE_CODES[status.code], status.message, retryable=status.retryable, terminal=True,
                          retry_after_ms=FULL_RETRY_AFTER_MS if status.retryable else 0), None
        credits = min(msg.proposed.credits or self.limits.max_credits, self.limits.max_credits)
        state.ring = _Ring(attach_token=msg.attach_token, push=push)
        state.open(msg.route_epoch, credits)
        state.last_active_ms = self.now_ms()
        self.stats.sessions.add("opened")
        if self.on_open is not None:
            self.on_open(sid)
        granted = self._limits_proto()
        granted.credits = credits
        return pb.SessionResponse(accepted=pb.SessionAccepted(session_id=sid, route_epoch=msg.route_epoch,
                                                              granted=granted, layers=self._layers)), sid

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

    def _remember_reaped(self, sid: str, why: pb.SessionResponse) -> None:
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

    def _forget(self, sid: str) -> None:
        with self._lock:
            self._states.pop(sid, None)

    def _rollback(self, sid: str, state: SessionState, msg: pb.RollbackSignal) -> pb.SessionResponse:
        with state.ring.lock:
            verdict = state.check_rollback(msg.route_epoch)
            if verdict is not Verdict.APPLY:
                code, detail, retryable = _VERDICT_ERRORS[verdict]
                return _error(code, f"rollback refused: {detail}", retryable=retryable)
            if len(msg.attach_token) > ATTACH_TOKEN_BYTES:  # refused before anything changes
                return _error(E.INVALID_ARGUMENT, f"an attach token is at most {ATTACH_TOKEN_BYTES} bytes")
            if msg.route_epoch > state.epoch:  # a newer route: this hop forwards nothing more until relinked
                state.ring.unlink()
                if msg.attach_token:  # and only the new route's previous hop may feed it
                    state.ring.attach_token = msg.attach_token
            status = self.engine.rollback(sid, msg.position)
            if not status.ok:
                return _error(_ENGINE_CODES[status.code], status.message)
            state.rolled_back(msg.route_epoch, msg.position)
            state.inputs.rollback(msg.position)
            state.outputs.rollback(msg.position)
        return pb.SessionResponse(ack=pb.Ack())

    # --- the ring ----------------------------------------------------------------------------

    def _link(self, state: SessionState, msg: pb.LinkSignal) -> pb.SessionResponse:
        """Dial the next hop its signed report names and attach to its session: this
        hop's outputs go there from now on. Every failure before the next hop proves
        its TLS identity is answered alike, and no earlier than ``link_answer_ms``
        after the link came: a client learns nothing of what answers at an address."""
        came = time.monotonic()
        ring = state.ring
        if ring.push is None:
            return _error(E.PROTOCOL, "this server cannot send a ring's copies: it serves no ring")
        if msg.route_epoch < state.epoch:
            return _error(E.EPOCH_STALE, "link refused: it carries a stale route epoch")
        if ring.links >= MAX_LINKS_PER_SESSION:
            return _error(E.INVALID_ARGUMENT, f"a session is linked at most {MAX_LINKS_PER_SESSION} times")
        who = state.claimant or IN_PROCESS
        with self._guard_lock:
            admitted = self._link_guard.admit(who.host, who.client, came)
        if not admitted:  # counted over time, whichever session asks: sessions are free to open
            self.stats.links.add("limited")
            return _error(E.LINK_LIMITED, "this peer makes no more ring links for this client now", retryable=True,
                          retry_after_ms=FULL_RETRY_AFTER_MS)
        ring.links += 1  # a dial costs this peer, whatever comes of it: counted first
        c = self.caps
        try:
            hop = next_hop(msg, now_ms=self.now_ms(), model_digest=c.model_digest, recipe_digest=c.recipe_digest,
                           end=c.end, total=c.source_layers)
        except (LinkError, ReportRefused) as e:  # nothing was dialled: the reason tells of the message only
            self.stats.links.add("report_refused")
            return _error(E.INVALID_ARGUMENT, str(e))
        backing_off, mine = self._may_dial(hop.target, came)
        try:
            return self._dial(state, msg, hop, came, backing_off)
        finally:
            if mine is not None:  # the links waiting on this dial look again: backing off now, or not
                with self._guard_lock:
                    self._dialling.pop(hop.target, None)
                mine.set()

    def _may_dial(self, target, came: float) -> tuple[bool, threading.Event | None]:
        """(whether ``target`` is backing off, the event this link sets once its dial
        is over if it is the one dialling). While a link dials a target, the others
        to it wait for its outcome: a burst of links to one victim is one dial."""
        with self._guard_lock:
            dialling = self._dialling.get(target)
            if dialling is None:
                if not self._link_guard.may_dial(target, came):
                    return True, None
                mine = self._dialling[target] = threading.Event()
                return False, mine
        dialling.wait(self.limits.link_answer_ms / 1000)
        with self._guard_lock:
            return not self._link_guard.may_dial(target, time.monotonic()), None

    def _dial(self, state: SessionState, msg: pb.LinkSignal, hop, came: float,
              backing_off: bool) -> pb.SessionResponse:
        ring = state.ring
        try:
            if backing_off:  # it failed lately: not dialled again, and answered as a failed dial is
                raise LinkError(UNREACHED, proven=False)
            link = RingLink(msg, hop, self._dial_credentials(), self._link_pool,
                            dial_timeout=self.limits.link_dial_ms / 1000)
        except LinkError as e:
            if not e.proven:
                self.stats.links.add("backing_off" if backing_off else "unreached")
                if not backing_off:
                    with self._guard_lock:
                        self._link_guard.failed(hop.target, time.monotonic())
                # the same answer at the same time, whether the port was closed, silent or closing
                time.sleep(max(0.0, came + self.limits.link_answer_ms / 1000 - time.monotonic()))
                return _error(E.LINK_FAILED, UNREACHED, retryable=True)
            self.stats.links.add("next_hop_refused")
            with self._guard_lock:
                self._link_guard.reached(hop.target)
            if e.full:  # the next hop has no worker to spare: busy, not faulty
                return _error(E.CAPACITY, str(e), retryable=True, retry_after_ms=FULL_RETRY_AFTER_MS)
            return _error(E.LINK_FAILED, str(e), retryable=True)
        self.stats.links.add("linked")
        with self._guard_lock:
            self._link_guard.reached(hop.target)
        with ring.lock:
            if msg.route_epoch < state.epoch:  # a rollback to a newer route came meanwhile
                link.close()
                return _error(E.EPOCH_STALE, "link refused: it carries a stale route epoch")
            ring.relink(link)
            state.epoch = msg.route_epoch
        return pb.SessionResponse(ack=pb.Ack())

    def _dial_credentials(self):
        """This peer's identity as a client certificate, for the ring's next hop (None: the process's own)."""
        if self.identity is None:
            return None
        with self._lock:
            made, creds = self._client_creds
            # the certificate lasts 24 h: a peer serving for days makes a new one twice a day
            if creds is None or time.monotonic() - made > DIAL_CERT_RENEW_S:
                creds = make_client_credentials(self.identity)
                self._client_creds = (time.monotonic(), creds)
            return creds

    def _attached(self, msg: pb.AttachOpen, request_iterator) -> Iterator[pb.SessionResponse]:
        """A stream that feeds an open session: steps only (and credit), answered only when they fail."""
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
        yield pb.SessionResponse(accepted=pb.SessionAccepted(session_id=sid, route_epoch=msg.route_epoch,
                                                              granted=granted, layers=self._layers))
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
                reply = self._step(sid, state, req.step, attached=True)
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

    def _after_step(self, state: SessionState, step: pb.Step, result, response: pb.SessionResponse,
                    attached: bool) -> pb.SessionResponse | None:
        """Under the ring lock: for a step the ring fed, send the owner its copy (first,
        ~0.07 ms: a next hop that holds the forward back must not make the client blame
        this one), then forward the output to the next hop, within a deadline."""
        ring = state.ring
        if attached and ring.push is not None:
            ring.push(response)
        link = ring.link
        if link is not None and link.epoch == step.route_epoch == state.epoch:
            out = response.result
            tail = result.token is not None
            if forwards(is_tail=tail, decode=step.decode, new_position=result.position,
                        forward_until=link.forward_until, is_eog=tail and result.token.is_eog,
                        stop_at_eog=link.stop_at_eog):
                if tail:
                    link.forward(result.position, True, token_id=result.token.token_id)
                else:
                    link.forward(step.position, step.decode, hidden=out.hidden)
        return None if attached else response

    def _attest(self, sid: str, state: SessionState) -> pb.SessionResponse:
        if self.identity is None:
            return _error(E.PROTOCOL, "this peer serves without an identity and cannot attest")
        c = self.caps
        a = Attestation(self.peer_id, sid, c.model_digest, c.recipe_digest, c.start, c.end, state.steps_done,
                        state.inputs.hexdigest(), state.outputs.hexdigest()).signed_by(self.identity)
        return pb.SessionResponse(attestation=pb.Attestation(
            peer_id=a.peer_id, session_id=a.session_id, model_digest=a.model_digest, recipe_digest=a.recipe_digest,
            start=a.start, end=a.end, steps=a.steps, input_digest=a.input_digest, output_digest=a.output_digest,
            signature=a.signature))

    def _step(self, sid: str, state: SessionState, step: pb.Step, *, attached: bool = False) -> pb.SessionResponse | None:
        """The reply to a step; for a step the ring fed (``attached``), None on
        success (the owner got its copy) and the error otherwise, which the owner
        gets too unless it is only an older route's step."""
        t0 = time.perf_counter()
        with state.ring.lock:
            reply = self._step_locked(sid, state, step, attached, t0)
        if reply is not None and reply.HasField("error"):
            self.stats.step_errors.add(E.Name(reply.error.code))
        if attached and reply is not None and reply.HasField("error") and reply.error.code != E.EPOCH_STALE \
                and state.ring.push is not None:
            state.ring.push(reply)
        return reply

    def _step_locked(self, sid: str, state: SessionState, step: pb.Step, attached: bool,
                     t0: float) -> pb.SessionResponse | None:
        wid, n = step.work_id, step.idempotency_step
        verdict = state.check_step(wid, n, step.route_epoch, step.deadline_unix_ms, self.now_ms())
        if verdict is Verdict.DUPLICATE:
            return pb.SessionResponse(ack=pb.Ack(work_id=wid, idempotency_step=n, duplicate=True))
        if verdict is not Verdict.APPLY:
            code, detail, retryable = _VERDICT_ERRORS[verdict]
            return _error(code, detail, work_id=wid, step=n, retryable=retryable)
        hidden = None
        if step.HasField("hidden"):
            try:
                hidden = bundle_from_proto(step.hidden)
            except PayloadError as e:
                return _error(E.PAYLOAD_CORRUPT, str(e), work_id=wid, step=n)
        tokens = tuple(step.token_ids) if hidden is None else None
        if len(step.token_ids) > self.limits.max_prefill_tokens:
            return _error(E.OVERSIZED, f"{len(step.token_ids)} tokens exceed {self.limits.max_prefill_tokens}", work_id=wid, step=n)
        try:  # a malformed step is refused before it counts: no credit spent, its idempotency step still free
            if step.decode:
                if tokens is not None and len(tokens) != 1:
                    return _error(E.INVALID_ARGUMENT, "a decode step carries exactly one token", work_id=wid, step=n)
                request = DecodeRequest(sid, step.position, token_id=tokens[0] if tokens else None, hidden=hidden)
            else:
                request = PrefillRequest(sid, step.position, token_ids=tokens, hidden=hidden)
        except ValueError as e:  # request types refuse malformed steps (no input, negative position)
            return _error(E.INVALID_ARGUMENT, str(e), work_id=wid, step=n)
        state.applied(n, step.route_epoch)
        state.running = wid
        t1 = time.perf_counter()
        try:
            result = self.engine.decode(request) if step.decode else self.engine.prefill(request)
        finally:
            state.running = None
        t2 = time.perf_counter()
        if not result.status.ok:
            s = result.status
            return _error(_ENGINE_CODES[s.code], s.message, work_id=wid, step=n, retryable=s.retryable)
        # what this step computed, for an attestation (a few microseconds per step)
        if hidden is not None:
            state.inputs.hidden(step.position, hidden)
        else:
            state.inputs.tokens(step.position, tokens)
        if result.token is not None:
            state.outputs.token(result.position - 1, result.token.token_id)
        else:
            state.outputs.hidden(step.position, result.hidden)
        state.steps_done += 1
        response = pb.SessionResponse()
        out = response.result  # built in place: wrapping a finished StepResult would copy its payload
        out.work_id = wid
        out.idempotency_step = n
        out.position = result.position
        out.route_epoch = step.route_epoch
        if result.token is not None:
            out.has_token = True
            out.token_id = result.token.token_id
            out.is_eog = result.token.is_eog
        else:
            bundle_to_proto(result.hidden, out=out.hidden)
        reply = self._after_step(state, step, result, response, attached)
        self._count_step(step.decode, result.position - step.position, t0, t1, t2)
        return reply

    def _count_step(self, decode: bool, rows: int, t0: float, t1: float, t2: float) -> None:
        s, kind = self.stats, "decode" if decode else "prefill"
        s.steps.add(kind)
        s.tokens.add(kind, rows)
        s.step_seconds["queue"].observe(t1 - t0)
        s.step_seconds["compute"].observe(t2 - t1)
        s.step_seconds["reply"].observe(time.perf_counter() - t2)
