"""What a session's messages do to its shard: steps, rollbacks and attestations.

A step is checked by the session's protocol state (session_state.py: its
epoch, deadline, idempotency step and credit), refused before it counts if
malformed, computed by the engine, added to the session's digests (what an
attestation signs), committed to (a signed commitment to its input and output,
chained per session: trust/commitment.py, sent with its reply or copy), and,
on a ring, its output copied to the owner's stream and forwarded to the next
hop (ring.py) with that commitment. A step the ring forwards here is applied
only if it is what the previous hop's commitment names as its output, signed
by the peer that attached (else UPSTREAM_MISMATCH). One step or rollback of a
session at a time, under its ring seat's lock, whichever stream it came on.
"""

from __future__ import annotations

import time

from meshnet_p2p.core import trace
from meshnet_p2p.engine.contract import DecodeRequest, PrefillRequest, StatusCode
from meshnet_p2p.engine.keepwarm import OFF
from meshnet_p2p.trust.attestation import Attestation
from meshnet_p2p.trust.commitment import Commitment, CommitmentError, hidden_digest, token_digest, tokens_digest
from . import wire
from .ring import ATTACH_TOKEN_BYTES, forwards
from .session_state import Verdict
from .wire import ErrorCode as E, PayloadError, bundle_from_proto, commitment_from_proto, reply_error as _error

ENGINE_CODES = {
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

VERDICT_ERRORS = {
    Verdict.CANCELLED: (E.CANCELLED, "work was cancelled", False),
    Verdict.EPOCH_STALE: (E.EPOCH_STALE, "step carries a stale route epoch", False),
    Verdict.DEADLINE: (E.DEADLINE_EXCEEDED, "the step's deadline has passed", False),
    Verdict.NO_CREDIT: (E.FLOW_CONTROL, "no flow-control credit left; top up in-band", True),
    Verdict.NOT_OPEN: (E.PROTOCOL, "step before SessionOpen", False),
}


class Steps:
    """A servicer's step machinery; ``state``: its per-session record (a
    SessionState with its ring seat)."""

    def __init__(self, engine, *, caps, limits, stats, now_ms, identity, peer_id: str, keep_warm=OFF) -> None:
        self.engine = engine
        self.keep_warm = keep_warm  # the CPUs kept awake for a while after each step (engine/keepwarm.py)
        self.caps = caps
        self.limits = limits
        self.stats = stats
        self.now_ms = now_ms
        self.identity = identity  # signs attestations of what a session computed
        self.peer_id = peer_id
        trace.name(f"peer {caps.start}:{caps.end}")

    def rollback(self, sid: str, state, msg):
        """Rewind the session to ``position``: a client's retry, or a ring's failover to a newer route."""
        with state.ring.lock:
            verdict = state.check_rollback(msg.route_epoch)
            if verdict is not Verdict.APPLY:
                code, detail, retryable = VERDICT_ERRORS[verdict]
                return _error(code, f"rollback refused: {detail}", retryable=retryable)
            if len(msg.attach_token) > ATTACH_TOKEN_BYTES:  # refused before anything changes
                return _error(E.INVALID_ARGUMENT, f"an attach token is at most {ATTACH_TOKEN_BYTES} bytes")
            if msg.route_epoch > state.epoch:  # a newer route: this hop forwards nothing more until relinked
                state.ring.unlink()
                if msg.attach_token:  # and only the new route's previous hop may feed it
                    state.ring.attach_token = msg.attach_token
            status = self.engine.rollback(sid, msg.position)
            if not status.ok:
                return _error(ENGINE_CODES[status.code], status.message)
            state.rolled_back(msg.route_epoch, msg.position)
            state.inputs.rollback(msg.position)
            state.outputs.rollback(msg.position)
        return wire.reply_ack()

    def _forward(self, state, step, result, response, commitment: Commitment | None):
        """Under the ring lock: forward the output to the next hop with this hop's
        commitment to it (the next hop takes nothing else), as far as the next hop's
        window admits at once (the rest after the copy: :meth:`_answer`). Returns the
        link it forwarded on, or None."""
        link = state.ring.link
        if link is None or not link.epoch == step.route_epoch == state.epoch:
            return None
        tail = result.token is not None
        if not forwards(is_tail=tail, decode=step.decode, new_position=result.position,
                        forward_until=link.forward_until, is_eog=tail and result.token.is_eog,
                        stop_at_eog=link.stop_at_eog):
            return None
        trace.event("fwd", pos=step.position)
        if tail:
            link.forward(result.position, True, token_id=result.token.token_id, is_eog=result.token.is_eog,
                         upstream=commitment)
        else:
            link.forward(step.position, step.decode, hidden=response.result.hidden, upstream=commitment)
        trace.event("fwded", pos=step.position)
        return link

    def _answer(self, state, step, response, attached: bool, forwarded):
        """Under the ring lock, after the forward: for a step the ring fed, send the
        owner its copy, then what of the forward the next hop's window held back
        (:meth:`RingLink.flush`, within a deadline). The forward is on the token's path
        and the copy is not, so the forward goes first; what the window holds back goes
        after the copy, so a next hop that holds its window back cannot make the client
        blame this one for a missing copy."""
        ring = state.ring
        if attached and ring.push is not None:
            trace.event("copy", pos=step.position)
            ring.push(response)
            trace.event("copied", pos=step.position)
        if forwarded is not None:
            forwarded.flush()
        return None if attached else response

    def _upstream(self, step, hidden, peer: str | None) -> tuple[Commitment | None, str | None]:
        """A forwarded step's previous hop's commitment, checked but for its signature:
        (it, None), or (None, why the step is refused). What the step carries must be
        what the commitment names as that hop's output, for these layers, from ``peer``,
        the identity its TLS proved when it attached (whose signature it must bear)."""
        if not step.HasField("upstream"):
            return None, "a forwarded step carries no commitment of the hop that computed it"
        if peer is None:
            return None, "the hop that forwards this step proved no identity its commitment could be signed with"
        c = self.caps
        try:
            up = commitment_from_proto(step.upstream).complete(
                peer_id=peer, model_digest=c.model_digest, recipe_digest=c.recipe_digest,
                route_epoch=step.route_epoch)
        except CommitmentError as e:
            return None, f"the previous hop's commitment is malformed: {e}"
        if up.end != (c.start or c.source_layers):  # a head's previous hop is the tail
            return None, "the previous hop's commitment is for layers that do not end where this hop's start"
        if hidden is not None:
            got = hidden_digest(step.position, hidden)
        elif len(step.token_ids) == 1:
            got = token_digest(step.position, step.token_ids[0], step.is_eog)
        else:
            return None, "a forwarded token step carries exactly one token"
        if got != up.output_digest:
            return None, f"the forwarded step is not what {peer} committed to as its output"
        return up, None  # its signature is checked after the forward: _step_locked

    def _commit(self, sid: str, state, step, hidden, tokens, result) -> Commitment | None:
        """This peer's signed commitment to a step it applied, chained to the session's last
        (~40-400 us to sign, cold or warm, and a sha256 of the step's input and output);
        the session's chain takes it once the step is answered (state.chained)."""
        if self.identity is None:  # a peer with no identity (in-process only) commits to nothing
            return None
        c = self.caps
        given = hidden_digest(step.position, hidden) if hidden is not None else tokens_digest(step.position, tokens)
        if result.token is not None:
            out = token_digest(result.position, result.token.token_id, result.token.is_eog)
        else:
            out = hidden_digest(step.position, result.hidden)
        index, prev = state.chain_head()
        return Commitment(self.peer_id, sid, c.model_digest, c.recipe_digest, c.start, c.end,
                          step.route_epoch, index, step.position, step.decode, given, out,
                          prev).signed_by(self.identity)

    def attest(self, sid: str, state):
        if self.identity is None:
            return _error(E.PROTOCOL, "this peer serves without an identity and cannot attest")
        c = self.caps
        a = Attestation(self.peer_id, sid, c.model_digest, c.recipe_digest, c.start, c.end, state.steps_done,
                        state.inputs.hexdigest(), state.outputs.hexdigest()).signed_by(self.identity)
        return wire.reply_attestation(a)

    def step(self, sid: str, state, step, *, attached: bool = False, feeder: str | None = None):
        """The reply to a step; for a step the ring fed (``attached``, by the peer
        ``feeder`` as its TLS proved it), None on success (the owner got its copy)
        and the error otherwise, which the owner gets too unless it is only an
        older route's step."""
        t0 = time.perf_counter()
        trace.event("step", pos=step.position, attached=attached)
        self.keep_warm.touch()  # awake from now until a window after this step: its next is due
        with state.ring.lock:
            reply = self._step_locked(sid, state, step, attached, feeder, t0)
        self.keep_warm.touch()
        if reply is not None and reply.HasField("error"):
            self.stats.step_errors.add(E.Name(reply.error.code))
        if attached and reply is not None and reply.HasField("error") and reply.error.code != E.EPOCH_STALE \
                and state.ring.push is not None:
            state.ring.push(reply)
        return reply

    def _step_locked(self, sid: str, state, step, attached: bool, feeder: str | None, t0: float):
        wid, n = step.work_id, step.idempotency_step
        verdict = state.check_step(wid, n, step.route_epoch, step.deadline_unix_ms, self.now_ms())
        if verdict is Verdict.DUPLICATE:
            return wire.reply_ack(wid, n, duplicate=True)
        if verdict is not Verdict.APPLY:
            code, detail, retryable = VERDICT_ERRORS[verdict]
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
        upstream = None
        if attached:  # the ring: only what the previous hop committed to (its signature: below)
            upstream, refused = self._upstream(step, hidden, feeder)
            if refused is not None:
                return _error(E.UPSTREAM_MISMATCH, refused, work_id=wid, step=n)
            trace.event("checked", pos=step.position)
        before = (state.last_step, state.credits, state.epoch)  # to undo, should its signature fail
        state.applied(n, step.route_epoch)
        state.running = wid
        t1 = time.perf_counter()
        trace.event("compute", pos=step.position)
        try:
            result = self.engine.decode(request) if step.decode else self.engine.prefill(request)
        finally:
            state.running = None
        t2 = time.perf_counter()
        trace.event("computed", pos=step.position)
        if not result.status.ok:
            s = result.status
            return _error(ENGINE_CODES[s.code], s.message, work_id=wid, step=n, retryable=s.retryable)
        commitment = self._commit(sid, state, step, hidden, tokens, result)
        trace.event("committed", pos=step.position)
        response = wire.reply_result(wid, n, result.position, step.route_epoch, token=result.token,
                                     hidden=result.hidden)
        wire.commit_result(response, commitment, upstream)
        forwarded = self._forward(state, step, result, response, commitment)
        # The previous hop's signature (~0.1-0.5 ms) is checked after the forward, off the
        # token's path, and before the step counts or its copy goes out: a step whose
        # signature fails is undone (the next hop's copy of what this one forwarded is
        # then an orphan the client's recovery rolls back) and refused as before.
        if upstream is not None and not upstream.verifies():
            self._undo(sid, state, step.position, before)
            if forwarded is not None:
                forwarded.flush()
            return _error(E.UPSTREAM_MISMATCH, f"the previous hop's commitment is not signed by {feeder}",
                          work_id=wid, step=n)
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
        if commitment is not None:
            state.chained(result.position, commitment.link())
        reply = self._answer(state, step, response, attached, forwarded)
        self._count_step(step.decode, result.position - step.position, t0, t1, t2)
        return reply

    def _undo(self, sid: str, state, position: int, before: tuple[int, int, int]) -> None:
        """A computed step refused after all: the shard forgets it and the session's
        protocol state is as before it (its idempotency step free, its credit back)."""
        self.engine.rollback(sid, position)
        state.last_step, state.credits, state.epoch = before

    def _count_step(self, decode: bool, rows: int, t0: float, t1: float, t2: float) -> None:
        s, kind = self.stats, "decode" if decode else "prefill"
        s.steps.add(kind)
        s.tokens.add(kind, rows)
        s.step_seconds["queue"].observe(t1 - t0)
        s.step_seconds["compute"].observe(t2 - t1)
        s.step_seconds["reply"].observe(time.perf_counter() - t2)
