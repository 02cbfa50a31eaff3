"""What one hop of a generation was given and answered, kept by the client so
that the hop's work can be checked later by exact replay on other peers of
the same recipe (replay.py) and, when it does not match, shown to others.

A transcript is plain data taken from an open (or closed) hop: the peer and
its span, the route's fingerprint and micro-batch size, the session's
sampling, and each step it computed, in order, as (position, input, decode)
with the peer's reply (its output, and its signed commitment when the peer
sends one). Steps a ring rolled back are not in it: a rollback is exact, so
the surviving steps replayed from an empty session reach the same state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from meshnet_p2p.dataplane.wire import Fingerprint
from meshnet_p2p.engine.contract import SamplingParams, TensorBundle

from meshnet_p2p.swarm.placement import span_network
from meshnet_p2p.trust.commitment import Commitment

from meshnet_p2p.route.hop import DishonestHop, Hop, commitments_of, route_fingerprint


@dataclass(frozen=True)
class StepRecord:
    position: int
    input: object  # token ids (a tuple) for a head, else a TensorBundle
    decode: bool
    reply: object  # the peer's StepReply: .hidden, or .token_id and .is_eog; .commitment when signed
    commitment: Commitment | None = None  # that commitment made whole (unverified here), when the peer signs

    @property
    def rows(self) -> int:
        return len(self.input) if not isinstance(self.input, TensorBundle) else self.input.tensors[0].shape[0]


@dataclass(frozen=True)
class HopTranscript:
    peer_id: str
    start: int
    end: int
    n_layer: int
    fingerprint: Fingerprint  # the route's: what every replayer is opened with
    n_ubatch: int
    sampling: SamplingParams
    max_tokens: int  # KV positions the session reserved (a replay reserves as many)
    session_id: str
    steps: tuple[StepRecord, ...]
    tokens: tuple[int, ...] = ()  # the route's token ids from position 0 (a proof carries them: trust/fraud_proof.py)
    cuts: tuple[int, ...] = ()  # the first layers of the route's hops before this one (a later hop's inputs)
    network: str = ""  # the network the peer counts in (placement.span_network): no replayer of it is its witness

    @property
    def is_tail(self) -> bool:
        return self.end == self.n_layer


def route_tokens(hops: Sequence[Hop]) -> tuple[int, ...]:
    """The token ids a route's head was given, from position 0 (the head hop that computed most)."""
    heads = [h for h in hops if h.span.start == 0 and h.history]
    if not heads:
        return ()
    ids: list[int] = []
    for position, payload, _ in max(heads, key=lambda h: len(h.history)).history:
        if position != len(ids) or isinstance(payload, TensorBundle):
            return ()  # not one contiguous sequence from 0: nothing to carry
        ids.extend(payload)
    return tuple(ids)


def transcript_of(hop: Hop, n_layer: int, sampling: SamplingParams, max_tokens: int,
                  tokens: tuple[int, ...] = (), cuts: tuple[int, ...] = ()) -> HopTranscript:
    try:
        signed = commitments_of(hop, verify=False)  # a proof carries the step's; its signature is checked there
    except DishonestHop:
        signed = []
    if len(signed) != len(hop.history):  # a peer that signs nothing (or not every step): no commitments
        signed = [None] * len(hop.history)
    steps: Sequence[StepRecord] = [StepRecord(p, x, d, r, c)
                                   for (p, x, d), r, c in zip(hop.history, hop.replies, signed)]
    return HopTranscript(hop.span.peer_id, hop.span.start, hop.span.end, n_layer,
                         route_fingerprint(hop.span.record.content), hop.n_ubatch, sampling, max_tokens,
                         hop.stream.session_id, tuple(steps), tokens, cuts, span_network(hop.span))
