"""``meshnet-peer audit``: check one peer's work by exact replay, on demand.

Runs a short greedy generation over a star route that goes through PEER (its
span forced in, the cheapest chains of the certified recipe before and after
it), keeps PEER's hop's transcript, and audits it (verify/replay.py): replays
its steps on other peers of the recipe and compares every output exactly.
Prints the verdict (``--json``: one object). A mismatch's proof, when others
can check it, is published as a signed fraud report (``--no-publish``: not).
Exit status: 0 match, 3 mismatch (proven by two independent replays), 2 when it
cannot decide (unconfirmed, undecided, no replayer), 1 on errors.

``--recheck``: instead, fetch the fraud reports others published against PEER
and re-check each by this machine's own replays (verify/recheck.py): exit 3
if one is confirmed, 2 if one could not be decided, else 0 (none, or all
refuted). docs/verification.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Iterable

from meshnet_p2p.core.errors import MeshnetError, sanitize
from .flags import add_bootstrap, add_trust, peer_id, positive, positive_float  # light, as this module

if TYPE_CHECKING:  # cli.py imports this module to build its parser: the rest loads when the role runs
    from meshnet_p2p.client import Client
    from meshnet_p2p.verify.replay import AuditResult

DEFAULT_PROMPT = "The capital of France is"
DEFAULT_TOKENS = 8

EXIT_MATCH = 0
EXIT_ERROR = 1
EXIT_UNDECIDED = 2
EXIT_MISMATCH = 3


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("audit", help="check a peer's work: generate through it, replay its steps on other "
                                            "peers of its recipe, compare exactly")
    add_bootstrap(p, "bootstrap peers (repeatable; default $MESHNET_BOOTSTRAP)")
    p.add_argument("--peer", required=True, type=peer_id, metavar="PEER_ID", help="the peer to audit")
    p.add_argument("--model", help="GGUF model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="what the audited generation is given")
    p.add_argument("--max-tokens", type=positive, default=DEFAULT_TOKENS, help="tokens the audited generation makes")
    p.add_argument("--step-timeout", type=positive_float, default=10.0)
    add_trust(p)
    p.add_argument("--no-publish", action="store_true", help="do not publish a mismatch's proof as a fraud report")
    p.add_argument("--recheck", action="store_true",
                   help="re-check the fraud reports others published against PEER, by replay, instead of auditing")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def generate_and_audit(client: "Client", peer_id: str, prompt: str, max_tokens: int, *,
                       exclude: Iterable[str] = (), own_replay=None) -> tuple[dict, "AuditResult"]:
    """A greedy generation through ``peer_id``, then the audit of its hop (replayed
    on peers other than ``exclude``, or by ``own_replay``: verify/oracle.py): what the
    generation did (route, tokens), and the audit's result."""
    from meshnet_p2p.verify.replay import audit_hop

    done, transcript, spans, opts = generate_through(client, peer_id, prompt, max_tokens)
    return done, audit_hop(transcript, spans, opts, exclude=exclude, measures=client.measures,
                           verified=client.records.verified, own_replay=own_replay)


def generate_through(client: "Client", peer_id: str, prompt: str, max_tokens: int):
    """A greedy generation over a star route through ``peer_id``: what it did (route,
    tokens), ``peer_id``'s hop transcript (with the route's tokens and cuts: what makes
    a proof others can re-check), a spans provider and the route's options."""
    import dataclasses

    import trio

    from meshnet_p2p.verify.replay import planner_through
    from meshnet_p2p.verify.auditor import transcripts
    from meshnet_p2p.route.generation import generate
    from meshnet_p2p.route.star import StarRoute
    from meshnet_p2p.client.text import prompt_ids
    from meshnet_p2p.engine.contract import SamplingParams

    def spans():  # a fresh survey each time (a trio loop of its own: this code blocks)
        return trio.run(client.spans)

    found = spans()
    if not any(s.peer_id == peer_id for s in found):
        raise MeshnetError(f"{peer_id} serves no layers of the certified recipe ({len(found)} peers do)")
    ids = prompt_ids(client.tokenizer, prompt, False)
    if not ids:
        raise MeshnetError("the prompt is empty")
    sampling = SamplingParams()  # greedy
    opts = dataclasses.replace(client.route_options(len(ids) + max_tokens, sampling, stop_at_eog=False),
                               ring=False, max_failovers=0, planner=planner_through(peer_id))
    route = StarRoute.open(spans, client.n_layer, opts, client.measures)
    try:
        gen = generate(route, ids, max_tokens, stop_at_eog=False)
        hop = next(h for h in route.hops if h.span.peer_id == peer_id)  # the planner put it there; no failover moved it
        transcript = next(t for t in transcripts(route, client.n_layer) if t.peer_id == hop.span.peer_id)
        done = {"route": route.route(), "token_ids": gen.token_ids}
    finally:
        route.close()  # before the audit: the replayers may be the same machines
    return done, transcript, spans, opts


def exit_code(verdict) -> int:
    from meshnet_p2p.verify.replay import Verdict

    return {Verdict.MATCH: EXIT_MATCH, Verdict.MISMATCH: EXIT_MISMATCH}.get(verdict, EXIT_UNDECIDED)


def run(args: argparse.Namespace) -> int:
    """The command (cli.main turns its errors into one escaped line and exit 1)."""
    from meshnet_p2p.client import Client
    from .flags import model_path, required_seeds, trust_policy

    seeds = required_seeds(args)
    events = (lambda msg: print(f"[{sanitize(msg)}]", file=sys.stderr, flush=True))
    client = Client(seeds, model_path=model_path(args.model), step_timeout=args.step_timeout, on_event=events,
                    trust=trust_policy(args, seeds), ring=False)
    try:
        if args.recheck:
            return _recheck(client, args)
        done, result = generate_and_audit(client, args.peer, args.prompt, args.max_tokens)
        published = None
        if result.proof is not None and result.proof.transferable() is None and not args.no_publish:
            _, published = client.exchange_reports([client.sign_report(result.proof)], [])
    finally:
        client.close()
    if args.json:
        print(json.dumps({**result.to_json(), **done, "published": published}))
    else:
        print(f"audit of {result.peer_id} (layers {result.start}-{result.end - 1}, {result.steps} steps): "
              f"{result.verdict.value}")
        print(f"  {result.detail}")
        if published is not None:
            print(f"  its proof published as a fraud report: {published} DHT node(s) took it")
    return exit_code(result.verdict)


def _recheck(client: "Client", args: argparse.Namespace) -> int:
    from meshnet_p2p.verify.recheck import Recheck

    found, _ = client.exchange_reports([], [args.peer])
    reports = found.get(args.peer, [])
    checked = [(str(r.signer), client.auditor.recheck(r)) for r in reports]
    outcomes = {c.outcome for _, c in checked if c is not None}
    if args.json:
        print(json.dumps({"peer": args.peer, "reports": [{"reporter": who, **(c.to_json() if c else {})}
                                                         for who, c in checked]}))
    else:
        print(f"{len(reports)} fraud report(s) against {args.peer}")
        for who, c in checked:
            print(f"  from {who}: {c.outcome.value if c else 'malformed'}" + (f": {c.detail}" if c else ""))
    if Recheck.CONFIRMED in outcomes:
        return EXIT_MISMATCH
    return EXIT_UNDECIDED if outcomes - {Recheck.REFUTED} else EXIT_MATCH
