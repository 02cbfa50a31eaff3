"""Auditing one hop by exact replay.

Honest peers of one certified recipe compute bit-identical outputs for the
same steps in the same micro-batch structure (docs/verification.md). So a
hop's work is checked exactly: its recorded steps (a transcript.py
``HopTranscript``) are replayed, in order and with the same rows per step, on
a session of other peers of the recipe over the same layers (the exact span,
or, with a float32 seam, any chain of sub-spans that covers it: other seams do
not compose across cuts), opened with the hop's fingerprint, sampling and
max_tokens, and each step's output is compared with the peer's, byte for byte
(:func:`meshnet_p2p.trust.fraud_proof.output_digest`), up to the first difference.

A difference is not yet blame: it is replayed again on peers disjoint from the
first replayers. :func:`decide`, a pure function, turns the comparisons into
a verdict:

- ``match``: the first replay gave every step's output exactly;
- ``mismatch``: two independent replays agree with each other, not with the
  peer, at the first step that differs (with a :class:`FraudProof`);
- ``undecided``: the replays disagree with each other; the one outvoted is
  named as the suspect (the audited peer is not blamed);
- ``unconfirmed``: one replay differs and no disjoint second one could be run:
  no blame;
- ``no-replayer``: no other peer could replay the hop.

A replayer that fails (refuses, breaks, errs) is set aside as a route search
does, and another chain is tried; that costs the audited peer nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Iterable, Sequence

from meshnet_p2p.core.errors import sanitize
from meshnet_p2p.dataplane.stub import ShardConnectionError, ShardError
from meshnet_p2p.swarm.placement import NoRoute, Span, plan_route, span_network
from meshnet_p2p.trust.fraud_proof import MAX_PROOF_STEPS, MAX_PROOF_TOKENS, ChainLink, FraudProof, output_digest

from meshnet_p2p.route.chain import Chain
from meshnet_p2p.route.errors import ClientClosed, GenerationError, RequestRefused, is_full
from meshnet_p2p.route.hop import route_fingerprint
from meshnet_p2p.route.options import PeerMeasures, RouteOptions
from meshnet_p2p.route.search import RouteSearch

from .transcript import HopTranscript, StepRecord

MAX_CHAINS = 4  # replay chains one replay tries before it gives up (a failing replayer is set aside)


class Verdict(str, Enum):
    MATCH = "match"
    MISMATCH = "mismatch"
    UNDECIDED = "undecided"
    UNCONFIRMED = "unconfirmed"
    NO_REPLAYER = "no-replayer"


# --- the decision: pure --------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplayRun:
    """One replay: the peers of its chain, and the output digest of each step it
    replayed, in order (it stops at its first step that differs from the peer's)."""

    replayers: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    step: int | None = None  # the first step whose outputs differ (the first replay's)
    suspect: tuple[str, ...] = ()  # undecided: the replayers outvoted
    note: str = ""  # undecided: why, when it is not the replays' disagreement


def first_difference(a: Sequence[str], b: Sequence[str]) -> int | None:
    """The first index where ``a`` and ``b`` differ, over their common length."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def decide(peer: Sequence[str], first: ReplayRun | None, second: ReplayRun | None) -> Decision:
    """The verdict from the peer's outputs and up to two replays (``second`` replays
    the steps up to the first replay's first difference, on disjoint peers)."""
    if first is None:
        return Decision(Verdict.NO_REPLAYER)
    k = first_difference(peer, first.outputs)
    if k is None:
        if len(first.outputs) != len(peer):
            raise ValueError(f"a replay that matched gave {len(first.outputs)} of {len(peer)} steps")
        return Decision(Verdict.MATCH)
    if second is None:
        return Decision(Verdict.UNCONFIRMED, k)
    j = first_difference(peer[: k + 1], second.outputs)
    if j is None:  # the second replay gives what the peer gave: the first replayers are the odd ones
        if len(second.outputs) != k + 1:
            raise ValueError(f"the second replay gave {len(second.outputs)} of {k + 1} steps")
        return Decision(Verdict.UNDECIDED, k, first.replayers)
    if j < k:  # the second differs where the peer and the first replay agree: it is the odd one
        return Decision(Verdict.UNDECIDED, k, second.replayers)
    if second.outputs[k] == first.outputs[k]:  # two independent replays agree, against the peer
        return Decision(Verdict.MISMATCH, k)
    return Decision(Verdict.UNDECIDED, k)  # three different answers: nobody is outvoted


# --- planning replays, and a route through a given peer: pure ------------------------------------


def seam_composes(t: HopTranscript) -> bool:
    """Whether a chain of sub-spans computes the hop's outputs exactly: a float32 seam only."""
    return t.fingerprint.recipe_axes.get("seam_dtype") == "f32"


def replay_planner(exact_span: bool, avoid: set[str], networks: set[str] = frozenset(),
                   verified: Callable[[str], bool] | None = None) -> Callable[..., list[Span]]:
    """plan_route over peers not in ``avoid`` nor in ``networks`` (both read at each plan:
    they grow as replayers are used or fail), only over spans that are exactly the hop's
    when ``exact_span``. A replayer in the audited peer's network, or in the first replay's,
    is no independent witness: many identities of one network are one (issue 59).
    ``verified``: peers with a record here are preferred, as a route's are: a conviction
    needs a replay wholly on such peers, so an audit looks for one where one exists."""

    def plan(spans: Iterable[Span], start: int, end: int, **kw) -> list[Span]:
        usable = [s for s in spans if s.peer_id not in avoid and span_network(s) not in networks
                  and (not exact_span or (s.start, s.end) == (start, end))]
        if verified is not None and "prefer" not in kw:
            kw["prefer"] = {s.peer_id for s in usable if verified(s.peer_id)}
        return plan_route(usable, start, end, **kw)

    return plan


def planner_through(peer_id: str) -> Callable[..., list[Span]]:
    """plan_route, with ``peer_id``'s span forced in whenever it lies inside the
    layers planned: the cheapest chains before and after it, around it. A plan
    that must take it while it is banned (it failed) has no route."""

    def plan(spans: Iterable[Span], start: int, end: int, *, banned: set[str] = frozenset(), **kw) -> list[Span]:
        spans = list(spans)
        mine = next((s for s in spans if s.peer_id == peer_id), None)
        if mine is None or not (start <= mine.start and mine.end <= end):
            return plan_route(spans, start, end, banned=set(banned) | {peer_id}, **kw)
        if peer_id in banned:
            raise NoRoute([(mine.start, mine.end)], f"the audited peer {peer_id} was set aside")
        others = set(banned) | {peer_id}
        before = plan_route(spans, start, mine.start, banned=others, **kw) if start < mine.start else []
        after = plan_route(spans, mine.end, end, banned=others, **kw) if mine.end < end else []
        return [*before, mine, *after]

    return plan


# --- the audit: replays on the network -----------------------------------------------------------


@dataclass(frozen=True)
class AuditResult:
    verdict: Verdict
    peer_id: str
    start: int
    end: int
    steps: int  # steps in the hop's transcript
    replayers: tuple[tuple[str, ...], ...]  # each replay's chain, first replay first
    step: int | None = None  # the first step that differs
    position: int | None = None  # its position
    suspect: tuple[str, ...] = ()
    detail: str = ""
    proof: FraudProof | None = None  # with a mismatch

    def to_json(self) -> dict:
        return {"verdict": self.verdict.value, "peer": self.peer_id, "span": [self.start, self.end],
                "steps": self.steps, "replayers": [list(r) for r in self.replayers], "step": self.step,
                "position": self.position, "suspect": list(self.suspect), "detail": self.detail,
                "proof": _hex_bytes(self.proof.to_content()) if self.proof else None}


def _hex_bytes(x):
    """A record's content for JSON: bytes (a commitment's digests and signature) as hex."""
    if isinstance(x, bytes):
        return x.hex()
    if isinstance(x, dict):
        return {k: _hex_bytes(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_hex_bytes(v) for v in x]
    return x


def step_output(record: StepRecord) -> object:
    reply = record.reply
    return reply.hidden if reply.hidden is not None else reply


def audit_hop(transcript: HopTranscript, spans_provider: Callable[[], list[Span]], opts: RouteOptions, *,
              exclude: Iterable[str] = (), measures: PeerMeasures | None = None,
              peer_outputs: Sequence[str] | None = None,
              verified: Callable[[str], bool] | None = None,
              own_replay: Callable[[HopTranscript], ReplayRun | None] | None = None) -> AuditResult:
    """Replay ``transcript``'s steps on peers other than its own and ``exclude``,
    and say whether the hop computed what the recipe computes (see the module's
    docstring). ``opts``: how to reach peers (timeouts, credentials, pool,
    on_event); the replay's own session settings come from the transcript.
    ``peer_outputs``: the output digests the peer is held to (default: those of
    its replies; a proof's re-check gives those the peer signed). Replayers are
    taken from other networks than the peer's, and the second replay's from other
    networks than the first's. ``verified``: whose records this node holds; with it,
    two replays that agree against the peer convict only when one of them ran
    wholly on such peers (else undecided, nobody blamed). ``own_replay``: this
    node's own replay of the hop (verify/oracle.py: a certifier holding the whole
    model), or None where it has none; when it has one, it alone decides: this
    node's own computation is the one witness it needs.
    Blocking, like the client's stepping; closes every session it opens."""
    t = transcript
    if not t.steps:
        raise ValueError("a transcript with no steps has nothing to audit")
    peer = list(peer_outputs) if peer_outputs is not None else \
        [output_digest(s.position, step_output(s)) for s in t.steps]
    mine = own_replay(t) if own_replay is not None else None
    if mine is not None:
        k = first_difference(peer, mine.outputs)
        d = Decision(Verdict.MATCH) if k is None else Decision(Verdict.MISMATCH, k, note="own")
        return _result(t, d, (mine.replayers,), peer, mine)
    avoid, networks = {t.peer_id, *exclude}, set()
    search = replay_search(t, spans_provider, opts, measures, replay_planner(not seam_composes(t), avoid, networks,
                                                                           verified))
    networks.update(_networks(search, [t.peer_id], t.network))
    first = _replay(search, t, len(t.steps), peer, avoid)
    second = None
    if first is not None and first_difference(peer, first.outputs) is not None:
        k = first_difference(peer, first.outputs)
        avoid.update(first.replayers)  # a second opinion from peers disjoint from the first
        networks.update(_networks(search, first.replayers))  # and from other networks than theirs
        second = _replay(search, t, k + 1, peer, avoid)
    d = decide(peer, first, second)
    if d.verdict is Verdict.MISMATCH and verified is not None \
            and not any(all(verified(p) for p in r.replayers) for r in (first, second)):
        # two replays agree against the peer, but no witness has a record with this node: identities
        # on two networks cost an attacker little, and an honest peer is never convicted by them
        d = Decision(Verdict.UNDECIDED, d.step, note="two replays agree against the peer, but neither ran wholly "
                                                     "on peers with a verified record here")
    runs = tuple(r.replayers for r in (first, second) if r is not None)
    return _result(t, d, runs, peer, first)


def _networks(search: RouteSearch, peers: Iterable[str], known: str = "") -> set[str]:
    """The networks ``peers`` count in, as the search's spans show them (``known``: one
    already known, e.g. the audited peer's from its route, which it may have left)."""
    peers = set(peers)
    found = {span_network(s) for s in search.spans if s.peer_id in peers}
    return found | {known} if known else found


def replay_search(t: HopTranscript, spans_provider: Callable[[], list[Span]], opts: RouteOptions,
                  measures: PeerMeasures | None, planner: Callable[..., list[Span]]) -> RouteSearch:
    """A route search over peers of ``t``'s fingerprint, planned by ``planner``, opened
    with ``t``'s sampling and max_tokens, surveyed."""
    replay_opts = dataclasses.replace(opts, max_tokens=t.max_tokens, sampling=t.sampling, ring=False, attest=False,
                                      max_failovers=0, planner=planner)

    def same_recipe() -> list[Span]:  # only peers of the hop's own fingerprint replay it
        return [s for s in spans_provider() if s.record is not None and route_fingerprint(s.record.content) == t.fingerprint]

    search = RouteSearch(same_recipe, replay_opts, measures)
    search.survey()
    return search


def _replay(search: RouteSearch, t: HopTranscript, n_steps: int, peer: list[str], avoid: set[str]) -> ReplayRun | None:
    """The first ``n_steps`` of ``t`` replayed on a chain of peers not in ``avoid``,
    stopping at the first output that differs from the peer's; None when no chain could."""
    steps = t.steps[:n_steps]
    got = replay_steps(search, t.start, t.end, t.n_layer, steps, avoid,
                       stop=lambda i, out: output_digest(steps[i].position, out) != peer[i])
    if got is None:
        return None
    replayers, outputs = got
    return ReplayRun(replayers, tuple(output_digest(s.position, o) for s, o in zip(steps, outputs)))


def replay_steps(search: RouteSearch, start: int, end: int, n_layer: int, steps: Sequence, avoid: set[str], *,
                 stop: Callable[[int, object], bool] = lambda i, out: False) -> tuple[tuple[str, ...], list] | None:
    """``steps`` (each with .position, .input, .decode) through layers [start, end) in order,
    on one chain of peers not in ``avoid``: (its peers, what its last hop gave at each step),
    ending after the first step ``stop`` says to. A replayer that fails is set aside (``avoid``,
    banned unless it was only full) and another chain tried, up to MAX_CHAINS; None when no
    chain could run."""
    on_event = search.opts.on_event
    for _ in range(MAX_CHAINS):
        try:
            hops = search.open_chain(start, end, 0)
        except ClientClosed:
            raise  # not a replayer's failure: the audit stops, with no verdict
        except (GenerationError, RequestRefused, NoRoute) as e:
            on_event(f"no replayer for layers {start}-{end - 1}: {e}")
            return None
        chain = Chain(hops, search, n_layer)
        at = hops[0]
        try:
            outputs: list = []
            for i, step in enumerate(steps):
                payload = step.input
                for at in hops:
                    payload = chain.through(at, step.position, payload, step.decode)
                outputs.append(payload)
                if stop(i, payload):
                    break
            return tuple(h.span.peer_id for h in hops), outputs
        except (ShardConnectionError, ShardError) as e:  # the replayer's failure, not the audited peer's
            avoid.add(at.span.peer_id)
            if not is_full(e):
                search.ban(at.span.peer_id)
            on_event(f"replayer {at.span.peer_id} failed ({sanitize(e)}); trying another")
        finally:
            chain.close()
    return None


def _result(t: HopTranscript, d: Decision, runs: tuple[tuple[str, ...], ...], peer: list[str],
            first: ReplayRun | None) -> AuditResult:
    span = f"layers {t.start}-{t.end - 1}"
    base = dict(verdict=d.verdict, peer_id=t.peer_id, start=t.start, end=t.end, steps=len(t.steps), replayers=runs)
    if d.verdict is Verdict.NO_REPLAYER:
        return AuditResult(**base, detail=f"no other peer of the recipe could replay {span}")
    if d.verdict is Verdict.MATCH:
        return AuditResult(**base, detail=f"{len(t.steps)} steps replayed on {', '.join(runs[0])}: every output "
                                          "is exactly the peer's")
    k = d.step
    position = t.steps[k].position
    where = f"step {k} (position {position})"
    base.update(step=k, position=position)
    if d.verdict is Verdict.UNCONFIRMED:
        return AuditResult(**base, detail=f"{where}: the replay on {', '.join(runs[0])} differs from the peer; no "
                                          "disjoint second replayer could confirm it (no blame)")
    if d.verdict is Verdict.UNDECIDED:
        who = f"{', '.join(d.suspect)} is the odd one" if d.suspect else "three different outputs"
        why = d.note or f"the replays disagree with each other ({who})"
        return AuditResult(**base, suspect=d.suspect, detail=f"{where}: {why}; the peer is not blamed")
    proof = FraudProof(t.peer_id, t.fingerprint.model_digest, t.fingerprint.recipe_digest, t.start, t.end,
                       t.n_layer, t.session_id, k, position, peer[k], first.outputs[k],
                       tuple(dict.fromkeys(p for r in runs for p in r)), t.sampling, t.max_tokens,
                       *_carried(t, k))
    if d.note == "own":
        return AuditResult(**base, proof=proof, detail=f"{where}: this node's own replay ({', '.join(runs[0])}, on "
                                                       "its own copy of the weights) differs from the peer")
    return AuditResult(**base, proof=proof, detail=f"{where}: two independent replays ({'; '.join(', '.join(r) for r in runs)}) "
                                                   "agree with each other and differ from the peer")


def _carried(t: HopTranscript, k: int) -> tuple:
    """What makes a proof transferable (trust/fraud_proof.py): the route's tokens to the end of
    step ``k``, the peer's commitments before it, and its signed one; none when the peer
    signed no commitments or they do not fit a proof."""
    signed = [s.commitment for s in t.steps[: k + 1]]
    end = t.steps[k].position + t.steps[k].rows
    if any(c is None for c in signed) or k + 1 > MAX_PROOF_STEPS or end > min(len(t.tokens), MAX_PROOF_TOKENS):
        return (), (), signed[k], ()
    return tuple(t.tokens[:end]), tuple(ChainLink.of(c) for c in signed[:k]), signed[k], t.cuts
