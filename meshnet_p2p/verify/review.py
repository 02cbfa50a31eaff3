"""A certifier's review round over the peers of a model's certified recipe: its
own audits and its re-checks of others' fraud reports, tallied and signed as
verdicts (issue 26, points 3-4), with the network calls passed in
(:class:`ReviewNet`). The command that runs rounds is ``meshnet-peer review``
(roles/review.py).

A round:

1. surveys the certified recipe's peers (a client that trusts the certifier's
   own key besides its bootstrap peers' and ``--trust``);
2. fetches every fraud report others published against them (earliest first)
   and re-checks them by its own replays (verify/recheck.py), one report of
   each peer in turn so that one peer's flood of reports does not starve
   another's: a report convicts only when those replays confirm it, never on
   its reporter's word; a peer with a report still unsettled (past the round's
   budget, or undecided) is not vouched for this round, whatever its audits say;
3. audits each peer it has not convicted (fewest verified sessions first, at
   most ``MAX_REVIEWED``): a greedy generation through the peer, its prompt and
   length drawn as users' are (:func:`audit_request`: a peer cannot tell the
   review's sessions from users' by a fixed prompt), its hop replayed exactly
   on other peers (roles/audit.py). A match is one verified session; a proven
   mismatch convicts the peer, and its proof, when others can check it, is
   published as a fraud report the certifier signs. Undecided and no-replayer
   give no verdict; unconfirmed (one replay differed, none could confirm)
   blames nobody but resets the peer's verified sessions, as a client's
   records do; a peer whose audit was undecided while a replayer of it was
   convicted in the same round is audited once more without it (the outcome
   does not hang on the order of audits);
4. signs its verdicts (trust/verdicts.py: the verified peers with their
   sessions, the convicted with why) and stores them as ``certify`` stores its
   evidence: on the nodes closest to the key and on the certifier's homes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from meshnet_p2p.core.errors import MeshnetError, sanitize

if TYPE_CHECKING:  # roles/review.py imports this module as cli.py builds its parser: the rest loads in a round
    from meshnet_p2p.core.identity import Identity
    from meshnet_p2p.core.records import Record
    from meshnet_p2p.dht.node import Stored
    from meshnet_p2p.swarm.placement import Span
    from .peer_records import PeerRecords
    from .recheck import RecheckResult
    from .replay import AuditResult

MAX_REVIEWED = 64  # peers audited a round (the least verified first: runs rotate through a larger swarm)
MAX_RECHECKS = 16  # others' fraud reports re-checked a round: each costs replays

# What a review's audited generation is given, drawn afresh for every audit: a cheater that
# lies only on some prompts (issue 59, the trigger) is not handed one fixed prompt to avoid.
# Many shapes (questions, instructions, continuations) over many subjects and lengths; an
# operator adds its own users' traffic with ``review --prompts-file``.
_SHAPES = ("What is {}?", "Tell me about {}.", "Explain {} to a child.", "Write a short poem about {}.",
           "The history of {} begins", "Here is what I know about {}:", "Q: Why does {} matter?\nA:",
           "My notes on {}, in three points:", "A friend asked me about {}, and I said", "{} is",
           "Summarize {} in one sentence.", "Is {} a good idea? Give reasons.", "Translate into French: {}.",
           "The best thing about {} is", "Compare {} with something familiar.")
_SUBJECTS = ("the capital of France", "a bank account", "the river bank", "passwords", "photosynthesis",
             "the moon landing", "interest rates", "a recipe for bread", "the stock market", "black holes",
             "my phone bill", "the French revolution", "python programming", "climate change", "a job interview",
             "the human heart", "medicine dosage", "the election", "football", "a loan application", "email security",
             "the ocean", "taxes", "a birthday party", "quantum computing", "chess openings", "a lost wallet",
             "online shopping", "the weather tomorrow", "a rental contract", "vaccines", "the speed of light")
AUDIT_TOKENS = (4, 24)  # how many tokens an audited generation makes, drawn in this range


def audit_request(rng: random.Random, prompts: Sequence[str] = (), tokens: tuple[int, int] = AUDIT_TOKENS
                  ) -> tuple[str, int]:
    """A prompt and a length for one audited generation: from ``prompts`` (an operator's
    sample of real traffic) when given, else composed, and a length in ``tokens``."""
    prompt = rng.choice(list(prompts)) if prompts else rng.choice(_SHAPES).format(rng.choice(_SUBJECTS))
    return prompt, rng.randint(*tokens)


@dataclass
class ReviewNet:
    """What a round asks of the swarm (blocking calls): the real ones are
    roles/review.py's :func:`client_net`'s; tests give doubles."""

    survey: Callable[[], list["Span"]]  # the certified recipe's spans
    audit: Callable[[str, set], "AuditResult"]  # generate through a peer, audit its hop (replayers not in the set)
    fetch_reports: Callable[[list], Mapping[str, list["Record"]]]  # peer -> verified fraud report records
    recheck: Callable[["Record", set], "RecheckResult"]  # a report, re-checked by replays here (not on the set)
    publish: Callable[[list], tuple[list["Stored"], int]]  # (key, wire)s -> what took each; networks in sight


@dataclass
class PeerOutcome:
    """What a round found of one peer: ``how`` is an audit's verdict, ``report`` (a
    re-checked report convicted it), ``convicted`` (earlier), ``error``, or None."""

    peer_id: str
    start: int
    end: int
    how: str | None = None
    detail: str = ""


@dataclass
class RoundResult:
    peers: dict[str, PeerOutcome]
    verified: dict[str, int]  # what the signed verdicts say
    convicted: dict[str, str]
    reports: int = 0  # fraud reports of this round's proofs that some node took
    stored: int = 0  # nodes that took the verdicts
    networks: int = 0  # and their distinct networks
    warning: str = ""


@dataclass
class Heard:
    """What a run remembers of others' reports from round to round: the reports its
    re-checks settled (by signature: refuted, confirmed, or moot), not re-checked again,
    and the reporters it caught in a lie (a report its replays refuted), not heard again.
    An undecided report is re-checked in a later round."""

    liars: set = field(default_factory=set)
    settled: set = field(default_factory=set)


def in_turn(found: Mapping[str, list]) -> list[tuple[str, object]]:
    """(peer, report) pairs: each peer's first report, then each one's second, ...: a peer
    with many reports against it does not starve the others of re-checks."""
    out, lists, i = [], [(p, found[p]) for p in sorted(found)], 0
    while any(i < len(rs) for _, rs in lists):
        out += [(p, rs[i]) for p, rs in lists if i < len(rs)]
        i += 1
    return out


def to_review(spans: Sequence["Span"], tally: "PeerRecords", limit: int = MAX_REVIEWED) -> list["Span"]:
    """The spans whose peers a round audits: not convicted here, the least verified first."""
    caught, snap = tally.caught(), tally.snapshot()
    sessions = {p: r["verified_sessions"] for p, r in snap.items()}
    mine = {s.peer_id: s for s in spans if s.peer_id not in caught}
    return sorted(mine.values(), key=lambda s: (sessions.get(s.peer_id, 0), s.start, s.end, s.peer_id))[:limit]


def verdicts_of_tally(tally: "PeerRecords") -> tuple[dict[str, int], dict[str, str]]:
    """(verified: peer -> sessions, convicted: peer -> why) from the certifier's tally."""
    snap = tally.snapshot()
    convicted = {p: r["caught"] for p, r in snap.items() if r["caught"]}
    verified = {p: r["verified_sessions"] for p, r in snap.items() if r["verified_sessions"] > 0 and p not in convicted}
    return verified, convicted


def conviction(r: "AuditResult") -> str:
    """Why an audit convicts, short enough for a verdicts record (the replayers' IDs are in the report)."""
    return (f"its own audit: layers {r.start}-{r.end - 1}, step {r.step} (position {r.position}) differs from two "
            "independent replays that agree")


def review_round(net: ReviewNet, tally: "PeerRecords", identity: "Identity", model_digest: str, *,
                 now_ms: Callable[[], int], heard: Heard | None = None,
                 log: Callable[[str], None] = lambda m: None,
                 storage_warning: Callable[["Stored", int], str] = lambda held, visible: "") -> RoundResult:
    """One round (see the module's docstring); the verdicts are signed and published at its end.
    ``storage_warning`` says when too few networks hold them (the command passes roles/review.py's)."""
    from .recheck import Recheck
    from .replay import Verdict
    from meshnet_p2p.trust.verdicts import report_key, sign_report, sign_verdicts, verdicts_key

    me = str(identity.peer_id)
    heard = heard if heard is not None else Heard()
    spans = net.survey()
    outcomes = {s.peer_id: PeerOutcome(s.peer_id, s.start, s.end) for s in sorted(spans, key=lambda s: (s.start, s.peer_id))}
    for p, why in tally.caught().items():
        if p in outcomes:
            outcomes[p].how, outcomes[p].detail = "convicted", why

    # others' reports against the peers in view: each counts only as this machine's replays confirm it
    found = net.fetch_reports(sorted(p for p in outcomes if p not in tally.caught()))
    rechecks, unsettled = 0, set()
    for peer, record in in_turn(found):
        reporter = str(record.signer)
        if peer in tally.caught() or reporter in (me, peer, *heard.liars) or record.signature in heard.settled:
            continue
        if rechecks >= MAX_RECHECKS:
            unsettled.add(peer)  # not re-checked this round: not vouched for either
            continue
        rechecks += 1
        try:
            result = net.recheck(record, set(tally.caught()))
        except MeshnetError as e:
            log(f"could not re-check a fraud report from {record.signer} against {peer}: {sanitize(e)}")
            unsettled.add(peer)
            continue
        log(f"a fraud report from {record.signer} against {result.peer_id}: {result.outcome.value}")
        if result.outcome in (Recheck.UNDECIDED, Recheck.NO_REPLAYER):
            unsettled.add(peer)
            continue
        heard.settled.add(record.signature)
        if result.outcome is Recheck.REFUTED:
            heard.liars.add(reporter)
        if result.outcome is Recheck.CONFIRMED and result.peer_id in outcomes:
            why = f"a fraud report from {record.signer}, re-checked by replay"
            tally.catch(result.peer_id, why)
            outcomes[result.peer_id].how, outcomes[result.peer_id].detail = "report", f"{why}: {result.detail}"

    # its own audits; a proof others can check goes out as a report it signs
    reports: list[tuple[str, bytes]] = []
    results: dict[str, "AuditResult"] = {}

    def audit(s: "Span") -> None:
        o = outcomes[s.peer_id]
        try:
            r = net.audit(s.peer_id, set(tally.caught()))
        except MeshnetError as e:  # the peer left, no route through it...: no verdict
            o.how, o.detail = "error", sanitize(e)
            log(f"could not audit {s.peer_id}: {o.detail}")
            return
        results[s.peer_id] = r
        o.how, o.detail = r.verdict.value, r.detail
        if r.verdict is Verdict.MATCH:
            tally.matched(s.peer_id)
        elif r.verdict is Verdict.UNCONFIRMED:  # no blame, but its record starts again, as a client's does
            tally.unconfirmed(s.peer_id)
        elif r.verdict is Verdict.MISMATCH:
            tally.catch(s.peer_id, conviction(r))
            if r.proof is not None and r.proof.transferable() is None:
                try:
                    reports.append((report_key(model_digest, s.peer_id), sign_report(identity, r.proof, now_ms=now_ms())))
                except MeshnetError as e:  # too large for a record: convicted here all the same
                    log(f"the proof against {s.peer_id} is not reported: {sanitize(e)}")
        log(f"{s.start}:{s.end} {s.peer_id}: {r.verdict.value}")

    planned = to_review(spans, tally)
    for s in planned:
        audit(s)
    # an audit a replayer convicted since then made undecided: once more, without that replayer
    caught = tally.caught()
    for s in planned:
        r = results.get(s.peer_id)
        if r is not None and r.verdict is Verdict.UNDECIDED and s.peer_id not in caught \
                and any(p in caught for run in r.replayers for p in run):
            audit(s)

    verified, convicted = verdicts_of_tally(tally)
    for p in unsettled - set(convicted):  # a report it could not settle: no vouch this round (issue 59)
        if verified.pop(p, None) is not None and p in outcomes:
            outcomes[p].detail = (outcomes[p].detail + "; " if outcomes[p].detail else "") + \
                "not vouched for: a fraud report against it is not settled"
    wire = sign_verdicts(identity, model_digest, verified, convicted, now_ms=now_ms())
    stored, visible = net.publish([*reports, (verdicts_key(model_digest, me), wire)])
    held = stored[-1]
    if held.nodes == 0:
        raise MeshnetError("no node took the verdicts record; run review again, or add bootstrap peers")
    return RoundResult(outcomes, verified, convicted, reports=sum(1 for s in stored[:-1] if s.nodes),
                       stored=held.nodes, networks=held.networks, warning=storage_warning(held, visible))
