"""A ring route (docs/ring.md): each peer forwards its output to the next, the
tail its token to the head, and every hop sends the client a copy (one network
crossing a token per hop). The client reads the copies in route order; the
first that does not come names the hop at fault, which is replaced while the
others roll back to the failed step on a new route epoch, and the ring is
linked again.

Each copy carries the hop's signed commitment to its step and the previous
hop's, which the hop took the step with: the two commitments of one hop for
one step must be one. A hop that forwards one thing and copies the client
another is refused by the next hop (UPSTREAM_MISMATCH) or has signed two
commitments for one step: either way it is the one blamed (docs/ring.md)."""

from __future__ import annotations

import time
from typing import Sequence

from meshnet_p2p.core import trace
from meshnet_p2p.core.records import wall_ms
from meshnet_p2p.dataplane.ring import LINK_TIMEOUT_S
from meshnet_p2p.dataplane.stub import ShardConnectionError, ShardError
from meshnet_p2p.dataplane.wire import LinkOrder
from meshnet_p2p.trust.commitment import CommitmentError

from .chain import Chain
from .errors import GenerationError
from .failover import Fault, blame, replace_failed, rollback_others
from .hop import CONNECT_TIMEOUT_S, DishonestHop, Hop, check_commitment, commitments_of

MIN_LINK_PAUSE_S = 0.05  # the least wait before asking a peer that limited our links again
REPORT_MARGIN_MS = 15_000  # a ring link sends a report at least this far from expiry (a peer checks it)


class RingRoute(Chain):
    ring = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._ring_next: int | None = None  # the position the ring feeds the head itself next

    def _ready(self) -> None:
        self._recover(0, self._link())

    @property
    def _forward_until(self) -> int:
        return self.opts.max_tokens - 1  # generate()'s last decode step is at max_tokens - 2

    def step(self, position: int, token_ids: Sequence[int], decode: bool):
        """One step of the ring: sent to the head unless the tail fed it already,
        then every hop's copy read in route order (each the next one's input,
        kept for failover). The hop at fault (:meth:`_await_copy`) is replaced,
        the others rolled back to ``position``."""
        token_ids = tuple(token_ids)
        for _ in range(self.opts.max_failovers + 2):  # each pass either returns or spends a failover
            fault = None
            tail_fed = self._ring_next == position
            trace.event("client.step", pos=position, fed=tail_fed)
            if not tail_fed:
                try:
                    self.hops[0].stream.send_step(position, token_ids=token_ids, decode=decode,
                                                  idempotency_step=position + 1)
                except ShardConnectionError as e:
                    fault = (0, e)
            if fault is None:
                reply, fault = self._collect(position, token_ids, decode, tail_fed)
            if fault is None:
                nxt = position + 1
                self._ring_next = nxt if decode and nxt < self._forward_until and \
                    not (reply.is_eog and self.opts.stop_at_eog) else None
                return reply
            self._recover(position, fault)
        raise GenerationError(f"gave up after {self.opts.max_failovers} failovers")

    def _collect(self, position: int, token_ids: tuple[int, ...], decode: bool, tail_fed: bool = False):
        """Each hop's result for the step at ``position`` (``tail_fed``: the tail was to
        feed the head): (the tail's reply, None), or (None, (index of the hop at fault, why))."""
        rows = 1 if decode else len(token_ids)
        payload: object = token_ids
        reply = None
        k = len(self.hops)
        for i, hop in enumerate(self.hops):
            fault = self._await_copy(i, position, token_ids, decode, tail_fed and i == 0 and k > 1)
            if fault is not None:
                return None, fault
            try:
                reply = hop.stream.next_result(self.epoch, timeout=self.opts.step_timeout)
                trace.event("client.copy", pos=position, hop=i)
                if reply.position != position + rows:
                    raise ShardConnectionError(f"{hop.span.peer_id} sent the result of another step "
                                               f"(position {reply.position}, not {position + rows})")
                self.check_kind(hop, reply)
            except ShardError as e:
                if e.code_name == "UPSTREAM_MISMATCH":  # it refused what the hop before it forwarded
                    before = self.hops[(i - 1) % k]
                    return None, ((i - 1) % k, DishonestHop(before.span.peer_id, f"{hop.span.peer_id} refused the "
                                                            f"step {before.span.peer_id} forwarded: {e}"))
                return None, (i, e)
            except ShardConnectionError as e:
                return None, (i, e)
            fault = self._upstream_fault(i, reply)
            if fault is None:
                try:
                    check_commitment(hop, position, payload, reply)
                except DishonestHop as e:
                    fault = i, e
            if fault is not None:
                return None, fault
            hop.history.append((position, payload, decode))  # what it computed: replayed on failover
            hop.replies.append(reply)  # and what it answered: audited by replay (verify/transcript.py)
            payload = reply.hidden
        return reply, None

    def _await_copy(self, i: int, position: int, token_ids: tuple[int, ...], decode: bool,
                    tail_fed: bool) -> Fault | None:
        """Wait for hop ``i``'s copy of the step, cancelling nothing: None once it (or an
        error, or the stream's end) is there to read, else the hop at fault and why.
        A hop's input is the copy of the hop before it (the head's, for a step the tail
        feeds, the tail's token), and a hop may send its copy before all of its forward
        (what the next hop's window held back): one that dies in between leaves the next
        without input, late through no fault of its own. So a copy half a step timeout late first blames a hop whose own connection to
        this client has ended. For a ``tail_fed`` step the head is then fed by us (the same
        step number: it is taken once), so a tail frozen after its copy is the one that
        fails to answer. Only with no hop dead is the late hop blamed (docs/ring.md)."""
        hop, timeout = self.hops[i], self.opts.step_timeout
        if hop.stream.wait_result(self.epoch, timeout / 2):
            return None
        dead = self._dead(i)
        if dead is not None:
            return dead
        rest = timeout / 2
        if tail_fed:
            try:
                hop.stream.send_step(position, token_ids=token_ids, decode=decode, idempotency_step=position + 1)
            except ShardConnectionError as e:
                return i, e
            rest = timeout  # a whole step timeout for the step it now has from us
        if hop.stream.wait_result(self.epoch, rest):
            return None
        return self._dead(i) or (i, ShardConnectionError(f"{hop.span.peer_id} sent no result for position "
                                                         f"{position} within {timeout / 2 + rest:g} s"))

    def _dead(self, late: int) -> Fault | None:
        """A hop other than ``late`` whose own connection to this client has ended (a peer
        that died), and why: the one to blame before a hop that is only late."""
        for j, hop in enumerate(self.hops):
            if j != late and hop.stream.ended():
                return j, ShardConnectionError(f"{hop.span.peer_id}'s connection to this client ended "
                                               f"(while {self.hops[late].span.peer_id}'s copy was awaited)")
        return None

    def _upstream_fault(self, i: int, reply) -> Fault | None:
        """Whether hop ``i``'s copy names, as the commitment it took the step with, the one
        the hop before it sent this client for that step (the head's: the tail's last).
        Equal wire fields: one commitment, its signature checked after the generation.
        Else signatures decide on the spot: a relayed one that does not verify is hop
        ``i``'s fault (it must have checked it), two valid ones are the hop before's
        (it signed two commitments for one step: equivocation)."""
        k = len(self.hops)
        j = (i - 1) % k
        before = self.hops[j]
        mine = before.replies[-1].commitment if before.replies else None
        peer = self.hops[i].span.peer_id
        if mine is None:  # the hop before is unverified (or the client fed the head itself)
            return None
        up = reply.upstream
        if up is None:  # the client may have fed the head itself: only a later hop must name one
            return None if i == 0 else (i, DishonestHop(peer, f"{peer}'s copy names no commitment of the hop "
                                                              "it took the step from"))
        if up.names(mine):
            return None
        try:  # rare: its chain is rebuilt to name its commitment whole
            direct = commitments_of(before, verify=False)[-1]
        except DishonestHop as e:
            return j, e
        c = before.span.record.content
        try:
            relayed = up.complete(peer_id=before.span.peer_id, model_digest=c["model_digest"],
                                  recipe_digest=c["recipe_digest"], route_epoch=direct.route_epoch)
        except CommitmentError as e:  # malformed
            return i, DishonestHop(peer, f"{peer} relayed a malformed commitment: {e}")
        if not relayed.verifies():
            return i, DishonestHop(peer, f"{peer} relayed a commitment {before.span.peer_id} did not sign")
        if not direct.verifies():
            return j, DishonestHop(before.span.peer_id, f"{before.span.peer_id} sent this client a commitment "
                                                        "it did not sign")
        return j, DishonestHop(before.span.peer_id, f"{before.span.peer_id} signed two commitments for one step "
                                                    "(it forwarded one thing and copied this client another)")

    def _recover(self, position: int, fault: Fault | None) -> None:
        """Replace the hop at fault (and any that fails meanwhile), roll the others
        back to ``position`` on a new route epoch, and link the ring again. Steps
        of the old route still on their way are refused (EPOCH_STALE) or passed over."""
        failed: set[int] = set()  # indices into self.hops still to replace (closed already)
        while fault is not None:
            index, error = fault
            blame(self, self.hops[index], error, "rerouting the ring")
            failed.add(index)
            self.epoch += 1
            self._ring_next = None
            for hop in self.hops:  # what is past `position` is computed again, on the new route
                keep = [i for i, h in enumerate(hop.history) if h[0] < position]
                hop.history = [hop.history[i] for i in keep]
                hop.replies = [hop.replies[i] for i in keep]
            fault = rollback_others(self, failed, position) or replace_failed(self, failed) or self._link()

    def _link(self) -> Fault | None:
        """Tell every hop where its output goes: the next hop, the tail's to the head.
        Returns the hop at fault and why, if a link could not be made."""
        k = len(self.hops)
        for i, hop in enumerate(self.hops):
            nxt = self.hops[(i + 1) % k]
            # the hop dials only what the next hop's signed report binds: the newest one we hold
            order = LinkOrder(route_epoch=self.epoch, peer_id=nxt.span.peer_id, next_report=self._report_of(nxt),
                              session_id=nxt.stream.session_id, attach_token=nxt.attach_token,
                              forward_until=self._forward_until, stop_at_eog=self.opts.stop_at_eog)
            try:
                self._link_one(hop, order)
            except ShardError as e:
                if e.code_name == "CAPACITY":  # the next hop had no worker for the attach: busy, not faulty
                    return (i + 1) % k, e
                if e.code_name == "LINK_LIMITED":  # no more links for us even after waiting: route around it, no ban
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

    def _link_one(self, hop: Hop, order: LinkOrder) -> None:
        """Send ``hop`` its link. A peer that makes no more links for this client now
        (LINK_LIMITED: it bounds the dials one client may ask of it over time, and a
        client starting many short generations meets that bound) is asked again when
        it says, for up to a step's timeout in all: busy, not faulty, and routing
        around it would spend a failover where a wait costs less."""
        waited_until = time.monotonic() + self.opts.step_timeout
        while True:
            try:
                # the peer dials within LINK_TIMEOUT_S: wait past that, so its verdict comes first
                hop.stream.link(order, timeout=self.opts.step_timeout + LINK_TIMEOUT_S)
                return
            except ShardError as e:
                pause = max(e.retry_after_s, MIN_LINK_PAUSE_S)
                if e.code_name != "LINK_LIMITED" or not e.retryable or time.monotonic() + pause > waited_until:
                    raise
                self.opts.on_event(f"peer {hop.span.peer_id} makes no more ring links for this client now; "
                                   f"asking again in {pause:.1f} s")
                time.sleep(pause)

    def _report_of(self, hop: Hop) -> bytes:
        """The newest signed report of ``hop``'s peer this route holds (a long generation
        outlives the one it opened with: reports live minutes), surveyed afresh once if
        that one is about to expire."""
        def newest():  # a report saying it leaves is refused: its session still serves till it ends
            mine = [s.record for s in self.search.spans if s.peer_id == hop.span.peer_id and s.record is not None]
            return max([hop.span.record, *mine], key=lambda r: (not r.content.get("departing"), r.seq))
        record = newest()
        if record.expires_at_ms - wall_ms() < REPORT_MARGIN_MS:
            self.search.survey()
            record = newest()
        return record.wire

    def _takes_attach(self, hop: Hop) -> bool:
        """Whether ``hop``'s session takes, from this client, the attach its previous hop was asked to make."""
        return hop.client.can_attach(hop.stream.session_id, hop.attach_token, self.epoch,
                                     min(self.opts.step_timeout, CONNECT_TIMEOUT_S))
