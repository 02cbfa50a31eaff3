"""What a star route and a ring route share: the chain of open hops, the route
epoch, the failovers spent, one hop's step remembered for replay, and opening
(a named constructor: ``StarRoute.open`` / ``RingRoute.open``, or api.open_route;
the constructor itself does no I/O)."""

from __future__ import annotations

import time
import uuid
from typing import Callable, Sequence

from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.dataplane.stub import ShardConnectionError
from meshnet_p2p.engine.contract import TensorBundle
from meshnet_p2p.swarm.placement import Span

from .hop import Hop, check_commitment, commitments_of
from .options import PeerMeasures, RouteOptions
from .search import RouteSearch


class Chain:
    """One generation's sessions across a chain of peers covering ``n_layer`` layers.
    Subclasses step it (the ``Route`` of generation.py) and recover from failures."""

    ring = False  # whether peers forward to each other: steps are then numbered by position

    def __init__(self, hops: Sequence[Hop], search: RouteSearch, n_layer: int) -> None:
        if search.opts.ring != self.ring:
            raise ValueError(f"a {type(self).__name__} opens with options of ring={self.ring}")
        self.hops = list(hops)
        self.search = search
        self.opts = search.opts
        self.n_layer = n_layer
        self.session_id = uuid.uuid4().hex  # the route's own name (each hop's session has its own ID)
        self.epoch = 0
        self.failovers = 0
        self.retired: list[Hop] = []  # hops failed over, kept for their transcripts (audits)

    @classmethod
    def open(cls, spans_provider: Callable[[], list[Span]], n_layer: int, opts: RouteOptions,
             measures: PeerMeasures | None = None):
        """Survey, then find and open a session on every hop (see RouteSearch.open_chain);
        raises GenerationError or RequestRefused, leaving no session open."""
        search = RouteSearch(spans_provider, opts, measures)
        route = cls([], search, n_layer)  # refuses options of the other kind before any I/O
        search.survey()
        route.hops = search.open_chain(0, n_layer, route.epoch)
        try:
            route._ready()
        except BaseException:  # no session is left open on any peer
            route.close()
            raise
        return route

    def _ready(self) -> None:
        """What a route does once its hops are open, before its first step."""

    @property
    def n_ubatch(self) -> int:
        return self.hops[0].n_ubatch  # every hop serves the same recipe

    def through(self, hop: Hop, position: int, payload, decode: bool):
        """One hop of a step, remembered for replay; returns what the next hop takes
        (the tail's reply at the end). A peer that froze (or a route that died)
        misses step_timeout: ShardConnectionError."""
        hidden = isinstance(payload, TensorBundle)
        given = {"hidden": payload} if hidden else {"token_ids": payload}
        t0 = time.perf_counter()
        # a ring numbers steps by position, as its peers do when they feed each other
        n = position + 1 if self.ring else None
        reply = hop.stream.step(position, decode=decode, timeout=self.opts.step_timeout, idempotency_step=n, **given)
        if decode:  # what this peer costs per token, measured: it replaces its advertised throughput
            self.search.measures.decode_step(hop.span.peer_id, (time.perf_counter() - t0) * 1000)
        self.check_kind(hop, reply)
        check_commitment(hop, position, payload, reply)  # it signed for what it was given and answered
        hop.history.append((position, payload, decode))  # only what it really computed is replayed
        hop.replies.append(reply)  # and what it answered: audited by replay (verify/transcript.py)
        if self.opts.attest:
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

    def verify_commitments(self) -> int:
        """Check the signature and chain of every commitment the route's hops sent
        (those replaced too), off the token's path: after the generation (~0.12 ms a
        step and hop). Raises DishonestHop naming the first hop whose do not verify;
        returns how many did."""
        return sum(len(commitments_of(hop)) for hop in self.retired + self.hops)

    def check_kind(self, hop: Hop, reply) -> None:
        """A tail answers with a token, any other hop with a hidden state."""
        if (reply.token_id is None) if hop.span.end == self.n_layer else (reply.hidden is None):
            raise ShardConnectionError(f"{hop.span.peer_id} answered with the wrong kind of output for its layers")

    def route(self) -> list[dict]:
        return [{"peer_id": h.span.peer_id, "layers": [h.span.start, h.span.end]} for h in self.hops]

    def close(self) -> None:
        for hop in self.hops:
            try:
                hop.stream.release(timeout=self.opts.step_timeout)  # a peer that froze must not hang us here
            except MeshnetError:
                pass
            hop.client.close()
