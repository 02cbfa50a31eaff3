"""``meshnet-peer review``: a certifier reviews the peers of a model's certified
recipe by its own audits, and signs its verdicts (issue 26, points 3-4).

A round:

1. surveys the certified recipe's peers (a client that trusts the certifier's
   own key besides its bootstrap peers' and ``--trust``);
2. fetches the fraud reports others published against them and re-checks each
   by its own replays (client/recheck.py): a report convicts only when those
   confirm it, never on its reporter's word;
3. audits each peer it has not convicted (fewest verified sessions first, at
   most ``MAX_REVIEWED``): a short greedy generation through the peer, its hop
   replayed exactly on other peers (roles/audit.py). A match is one verified
   session; a proven mismatch convicts the peer, and its proof, when others can
   check it, is published as a fraud report the certifier signs. Undecided
   and no-replayer give no verdict; unconfirmed (one replay differed, none
   could confirm) blames nobody but resets the peer's verified sessions, as a
   client's records do; a peer whose audit was
   undecided while a replayer of it was convicted in the same round is audited
   once more without it (the outcome does not hang on the order of audits);
4. signs its verdicts (trust/verdicts.py: the verified peers with their
   sessions, the convicted with why) and stores them as ``certify`` stores its
   evidence: on the nodes closest to the key and on the certifier's homes.

The tally lives in a file of the certifier's own (:func:`review_path`, apart
from a client's records), so rounds and runs accumulate. The audits' sessions
go out under a fresh identity, as a user's do: a peer cannot single out the
certifier's sessions by their TLS identity. Clients that trust the certifier
count its verified peers as verified and leave its convicted ones out; others
ignore its verdicts (docs/verification.md, "Certifiers review peers").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from meshnet_p2p.core.errors import MeshnetError, sanitize, unwrap_errors
from .flags import add_bootstrap, add_trust, positive, positive_float  # light, as this module

if TYPE_CHECKING:  # cli.py imports this module to build its parser: the rest loads when the role runs
    from meshnet_p2p.client import Client
    from meshnet_p2p.client.audit import AuditResult
    from meshnet_p2p.client.recheck import RecheckResult
    from meshnet_p2p.client.records import PeerRecords
    from meshnet_p2p.core.identity import Identity
    from meshnet_p2p.core.records import Record
    from meshnet_p2p.dht.node import Stored
    from meshnet_p2p.swarm.placement import Span

DEFAULT_PROMPT = "The capital of France is"
DEFAULT_TOKENS = 4
MAX_REVIEWED = 64  # peers audited a round (the least verified first: runs rotate through a larger swarm)
MAX_RECHECKS = 16  # others' fraud reports re-checked a round: each costs replays

EXIT_PUBLISHED = 0
EXIT_ERROR = 1
EXIT_CONVICTED = 3


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("review", help="as a certifier: audit the peers of the certified recipe, re-check "
                                             "fraud reports against them, sign and publish the verdicts")
    add_bootstrap(p, "bootstrap peers (repeatable; default $MESHNET_BOOTSTRAP)")
    p.add_argument("--identity", required=True, help="the certifier's key file: signs the verdicts and fraud "
                                                     "reports (e.g. a bootstrap peer's, which clients trust)")
    p.add_argument("--model", help="GGUF model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--rounds", type=positive, default=1, help="review rounds, each published (default 1)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="what each audited generation is given")
    p.add_argument("--max-tokens", type=positive, default=DEFAULT_TOKENS, help="tokens each audited generation makes")
    p.add_argument("--step-timeout", type=positive_float, default=10.0)
    add_trust(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def review_path(model_digest: str, certifier: str) -> str:
    """Where a certifier keeps its tally of one model's peers (not a client's records file)."""
    from meshnet_p2p.engine.models import cache_dir

    return os.path.join(cache_dir(), "records", f"review-{model_digest}-{certifier}.msgpack")


# --- a round, with the network calls passed in ---------------------------------------------------


@dataclass
class ReviewNet:
    """What a round asks of the swarm (blocking calls): the real ones are
    :func:`client_net`'s; tests give doubles."""

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
    """What a run remembers of others' reports from round to round: the reports it
    re-checked (by signature), and the reporters it caught in a lie (a report its
    replays refuted), not heard again."""

    seen: set = field(default_factory=set)
    liars: set = field(default_factory=set)


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
                 log: Callable[[str], None] = lambda m: None) -> RoundResult:
    """One round (see the module's docstring); the verdicts are signed and published at its end."""
    from meshnet_p2p.client.audit import Verdict
    from meshnet_p2p.client.recheck import Recheck
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
    rechecks = 0
    for peer, records in sorted(found.items()):
        for record in records:
            reporter = str(record.signer)
            if peer in tally.caught() or reporter in (me, *heard.liars) or record.signature in heard.seen:
                continue
            if rechecks >= MAX_RECHECKS:
                break
            heard.seen.add(record.signature)
            rechecks += 1
            try:
                result = net.recheck(record, set(tally.caught()))
            except MeshnetError as e:
                log(f"could not re-check a fraud report from {record.signer} against {peer}: {sanitize(e)}")
                continue
            log(f"a fraud report from {record.signer} against {result.peer_id}: {result.outcome.value}")
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
    wire = sign_verdicts(identity, model_digest, verified, convicted, now_ms=now_ms())
    stored, visible = net.publish([*reports, (verdicts_key(model_digest, me), wire)])
    held = stored[-1]
    if held.nodes == 0:
        raise MeshnetError("no node took the verdicts record; run review again, or add bootstrap peers")
    return RoundResult(outcomes, verified, convicted, reports=sum(1 for s in stored[:-1] if s.nodes),
                       stored=held.nodes, networks=held.networks, warning=storage_warning(held, visible))


def storage_warning(held: "Stored", visible_networks: int) -> str:
    """As certify's storage_problem: too few networks hold the verdicts ("" if enough)."""
    from .certify import MIN_NETWORKS

    if held.networks >= min(MIN_NETWORKS, max(1, visible_networks)):
        return ""
    return (f"only {held.networks} network{'s' if held.networks != 1 else ''} of the {visible_networks} this node "
            f"sees hold the verdicts ({held.nodes} nodes): one operator there could hide them from readers; run "
            "review again later, or add bootstrap peers on other networks")


# --- the real network ----------------------------------------------------------------------------


def client_net(client: "Client", identity: "Identity", prompt: str, max_tokens: int) -> ReviewNet:
    """The round's calls on the swarm, through ``client`` (a star client, ring=False)."""
    import functools

    import trio

    from meshnet_p2p.client.recheck import recheck_proof
    from meshnet_p2p.engine.contract import SamplingParams
    from meshnet_p2p.swarm.fraud import exchange_reports
    from meshnet_p2p.trust.verdicts import proof_of
    from .audit import generate_and_audit

    def spans() -> list:
        return trio.run(client.spans)

    def audit(peer: str, exclude: set):
        return generate_and_audit(client, peer, prompt, max_tokens, exclude=exclude)[1]

    def fetch(peers: list) -> Mapping:
        return trio.run(functools.partial(exchange_reports, client.bootstrap, client.model_digest, (), peers))[0]

    def recheck(record, exclude: set):
        opts = client.route_options(1, SamplingParams(), False)  # the replays open sessions of their own
        return recheck_proof(proof_of(record), lambda: [s for s in spans() if s.peer_id not in exclude], opts,
                             measures=client.measures)

    def publish(items: list):
        return trio.run(publish_records, client.bootstrap, identity, items)

    return ReviewNet(spans, audit, fetch, recheck, publish)


async def publish_records(bootstrap: Sequence, identity: "Identity", items: list) -> tuple[list, int]:
    """Store each (key, wire) of ``items`` as certify stores evidence (the closest nodes and the
    certifier's homes), from a DHT node of a fresh identity (``identity`` may be a running
    bootstrap peer's: two nodes must not share a peer ID). What took each, and how many
    networks this node sees."""
    import trio

    from meshnet_p2p.core.identity import Identity
    from meshnet_p2p.core.netgroup import networks
    from meshnet_p2p.swarm.node import start_node
    from .certify import certifier_homes

    with unwrap_errors():
        async with trio.open_nursery() as nursery:
            node = await start_node(nursery, Identity.generate(), bootstrap=bootstrap, client_mode=True)
            homes = await certifier_homes(node, identity.peer_id)
            stored = [await node.publish(key, wire, also=homes) for key, wire in items]
            visible = networks([*node.table.contacts(), *homes])
            nursery.cancel_scope.cancel()
    return stored, visible


# --- the command ---------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """The command (cli.main turns its errors into one escaped line and exit 1)."""
    from meshnet_p2p.client import Client
    from meshnet_p2p.client.records import PeerRecords
    from meshnet_p2p.core.records import wall_ms
    from .flags import load_or_create_identity, model_path, required_seeds, trust_policy

    seeds = required_seeds(args)
    identity = load_or_create_identity(args.identity)
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else (lambda m: print(m, flush=True))
    events = (lambda msg: print(f"[{sanitize(msg)}]", file=sys.stderr, flush=True))
    # trust_policy counts --identity's key: the certifier's own certificates and earlier verdicts
    client = Client(seeds, model_path=model_path(args.model), step_timeout=args.step_timeout, on_event=events,
                    trust=trust_policy(args, seeds), ring=False)
    me = str(identity.peer_id)
    tally = PeerRecords(review_path(client.model_digest, me))
    net = client_net(client, identity, args.prompt, args.max_tokens)
    peers: dict[str, PeerOutcome] = {}
    heard = Heard()
    try:
        for n in range(1, args.rounds + 1):
            r = review_round(net, tally, identity, client.model_digest, now_ms=wall_ms, heard=heard,
                             log=events)
            peers.update(r.peers)
            say(f"review round {n}/{args.rounds} of model {client.model_digest[:12]} by {me}:")
            for o in r.peers.values():
                say(f"  {o.start}:{o.end} {o.peer_id}: {_verdict(o, r)}")
            say(f"verdicts: {len(r.verified)} verified, {len(r.convicted)} convicted; stored on {r.stored} nodes "
                f"in {r.networks} network{'s' if r.networks != 1 else ''}"
                + (f"; {r.reports} fraud report(s) published" if r.reports else ""))
            if r.warning:
                say(f"warning: {r.warning}")
    finally:
        client.close()
    if args.json:
        print(json.dumps({
            "certifier": me, "model_digest": client.model_digest, "rounds": args.rounds,
            "peers": {p: {"layers": [o.start, o.end], "audit": o.how, "verdict": _state(p, r), "detail": o.detail}
                      for p, o in peers.items()},
            "verified": r.verified, "convicted": r.convicted,
            "published": {"nodes": r.stored, "networks": r.networks, "fraud_reports": r.reports,
                          "warning": r.warning or None},
        }))
    return EXIT_CONVICTED if r.convicted else EXIT_PUBLISHED


def _state(peer: str, r: RoundResult) -> str | None:
    return "convicted" if peer in r.convicted else "verified" if peer in r.verified else None


def _verdict(o: PeerOutcome, r: RoundResult) -> str:
    """One peer's line: its standing in the signed verdicts, and what this round saw."""
    state = _state(o.peer_id, r)
    n = r.verified.get(o.peer_id, 0)
    head = {"convicted": "CONVICTED", "verified": f"verified ({n} session{'s' if n != 1 else ''})"}.get(
        state, "no verdict")
    if o.how is None:
        return head
    saw = {"no-replayer": "no other peer of the recipe can replay its layers"}.get(o.how, sanitize(o.detail, 300))
    return f"{head}; {o.how}: {saw}"
