"""Re-checking someone else's fraud proof by replay: what makes a proof count here.

A proof (trust/fraud_proof.py) is a claim by its reporter; it costs a stranger little
to publish one, so nothing is believed on its word. It counts for this node
when its own replays, on peers of the proof's recipe, show what the proof says:

1. the proof is transferable: the peer's signed, linked commitments to every
   step up to the one that differs, over the route's tokens;
2. the peer's inputs were honest: a head's are the tokens (its signed input
   digests say so); a later hop's are what the layers before it compute from
   those tokens, replayed here over the same cuts as the peer's route, and
   each must equal the input digest the peer signed for that step. If not,
   the proof does not stand against the peer (its predecessor fed it
   something else, or the reporter made the tokens up): ``inputs-differ``;
3. the peer's layers, replayed here from those inputs (replay.py: two disjoint
   replays before blame), differ from the outputs the peer signed:
   ``confirmed``. If they give exactly what it signed, the proof is false:
   ``refuted``, and its reporter is the one who lied.

Otherwise (replays that disagree, no replayer) nothing is concluded.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Iterable

from meshnet_p2p.swarm.placement import Span, plan_route
from meshnet_p2p.trust.commitment import hidden_digest
from meshnet_p2p.trust.fraud_proof import FraudProof

from meshnet_p2p.route.hop import route_fingerprint
from meshnet_p2p.route.options import PeerMeasures, RouteOptions

from .replay import AuditResult, Verdict, audit_hop, replay_search, replay_steps
from .transcript import HopTranscript, StepRecord


class Recheck(str, Enum):
    CONFIRMED = "confirmed"
    REFUTED = "refuted"
    INPUTS_DIFFER = "inputs-differ"
    UNDECIDED = "undecided"
    NO_REPLAYER = "no-replayer"
    NOT_TRANSFERABLE = "not-transferable"


@dataclass(frozen=True)
class RecheckResult:
    outcome: Recheck
    peer_id: str
    detail: str
    audit: AuditResult | None = None

    def to_json(self) -> dict:
        return {"outcome": self.outcome.value, "peer": self.peer_id, "detail": self.detail,
                "audit": self.audit.to_json() if self.audit else None}


def cut_planner(cuts: tuple[int, ...], end: int, avoid: set[str]) -> Callable[..., list[Span]]:
    """plan_route over peers not in ``avoid`` whose spans are exactly the hops between
    ``cuts`` (and ``end``): the route's own cuts, so seams round where they did."""
    pairs = set(zip(cuts, (*cuts[1:], end)))

    def plan(spans: Iterable[Span], start: int, stop: int, **kw) -> list[Span]:
        usable = [s for s in spans if s.peer_id not in avoid and (s.start, s.end) in pairs]
        return plan_route(usable, start, stop, **kw)

    return plan


def recheck_proof(proof: FraudProof, spans_provider: Callable[[], list[Span]], opts: RouteOptions, *,
                  measures: PeerMeasures | None = None, verified: Callable[[str], bool] | None = None,
                  own_replay=None) -> RecheckResult:
    """Check ``proof`` by this node's own replays (see the module's docstring).
    Blocking; ``opts`` says how to reach peers; closes every session it opens.
    ``verified``: as audit_hop's (a confirmation needs a witness this node has a record of);
    ``own_replay``: as audit_hop's (the peer's layers replayed on this node's own weights)."""
    why = proof.transferable()
    if why is not None:
        return RecheckResult(Recheck.NOT_TRANSFERABLE, proof.peer_id, why)
    commitments, steps = proof.commitments(), proof.steps()
    fingerprint = next((route_fingerprint(s.record.content) for s in spans_provider() if s.record is not None
                        and (s.record.content.get("model_digest"), s.record.content.get("recipe_digest"))
                        == (proof.model_digest, proof.recipe_digest)), None)
    if fingerprint is None:
        return RecheckResult(Recheck.NO_REPLAYER, proof.peer_id, "no peer of the proof's recipe is in sight")
    t = HopTranscript(proof.peer_id, proof.start, proof.end, proof.n_layer, fingerprint, 0, proof.sampling,
                      proof.max_tokens, proof.session_id,
                      tuple(StepRecord(p, ids, d, None, c) for (p, ids, d), c in zip(steps, commitments)),
                      proof.tokens, proof.cuts)
    if proof.start > 0:
        inputs = _honest_inputs(t, [c.input_digest for c in commitments], spans_provider, opts, measures)
        if isinstance(inputs, RecheckResult):
            return inputs
        t = dataclasses.replace(t, steps=tuple(StepRecord(s.position, x, s.decode, None, s.commitment)
                                               for s, x in zip(t.steps, inputs)))
    audit = audit_hop(t, spans_provider, opts, measures=measures,
                      peer_outputs=[c.output_digest.hex() for c in commitments], verified=verified,
                      own_replay=own_replay)
    outcome = {Verdict.MISMATCH: Recheck.CONFIRMED, Verdict.MATCH: Recheck.REFUTED,
               Verdict.NO_REPLAYER: Recheck.NO_REPLAYER}.get(audit.verdict, Recheck.UNDECIDED)
    detail = {Recheck.CONFIRMED: f"replayed here, {audit.detail}: the proof stands",
              Recheck.REFUTED: "replayed here, the peer's signed outputs are exactly what the recipe computes: "
                               "the proof is false"}.get(outcome, audit.detail)
    return RecheckResult(outcome, proof.peer_id, detail, audit)


def _honest_inputs(t: HopTranscript, signed: list[bytes], spans_provider, opts: RouteOptions,
                   measures: PeerMeasures | None) -> list | RecheckResult:
    """The hidden states the layers before ``t``'s compute from its tokens, replayed on two
    chains at most (the second disjoint from the first), when one gives exactly the input
    digests the peer signed; else why not."""
    avoid = {t.peer_id}
    cuts = t.cuts if t.cuts and t.cuts[0] == 0 else (0,)
    differs: list[int] = []  # per replay that ran: the first step whose input differs from the signed one
    for _ in range(2):
        search = replay_search(t, spans_provider, opts, measures, cut_planner(cuts, t.start, avoid))
        got = replay_steps(search, 0, t.start, t.n_layer, t.steps, avoid)
        if got is None:
            break
        replayers, outputs = got
        first = next((i for i, (s, h) in enumerate(zip(t.steps, outputs))
                      if hidden_digest(s.position, h) != signed[i]), None)
        if first is None:
            return outputs
        differs.append(first)
        avoid.update(replayers)  # perhaps those replayers lied: a second opinion before concluding
    if not differs:
        return RecheckResult(Recheck.NO_REPLAYER, t.peer_id, f"no peer could replay layers 0-{t.start - 1} "
                             "(the peer's inputs)")
    return RecheckResult(Recheck.INPUTS_DIFFER, t.peer_id,
                         f"{len(differs)} replay(s) of layers 0-{t.start - 1} give other inputs at step {differs[0]} "
                         "than the peer signed for, none the same: the proof does not stand against the peer")
