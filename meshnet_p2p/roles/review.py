"""``meshnet-peer review``: a certifier reviews the peers of a model's certified
recipe by its own audits, and signs its verdicts (issue 26, points 3-4).

A round (verify/review.py) audits the certified recipe's peers and re-checks the
fraud reports published against them, and the certifier signs and publishes
its verdicts.

The tally lives in a file of the certifier's own (:func:`review_path`, apart
from a client's records), so rounds and runs accumulate. The audits' sessions
go out under a fresh identity, as a user's do: a peer cannot single out the
certifier's sessions by their TLS identity. Clients that trust the certifier
count its verified peers as verified and leave its convicted ones out; others
ignore its verdicts (docs/verification.md, "Certifiers review peers").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import TYPE_CHECKING, Mapping, Sequence

from meshnet_p2p.core.errors import sanitize, unwrap_errors
from meshnet_p2p.verify.review import Heard, PeerOutcome, ReviewNet, RoundResult, audit_request, review_round  # light
from .flags import add_bootstrap, add_trust, positive, positive_float  # light, as this module

if TYPE_CHECKING:  # cli.py imports this module to build its parser: the rest loads when the role runs
    from meshnet_p2p.client import Client
    from meshnet_p2p.core.identity import Identity
    from meshnet_p2p.dht.node import Stored


EXIT_PUBLISHED = 0
EXIT_ERROR = 1
EXIT_CONVICTED = 3


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("review", help="as a certifier: audit the peers of the certified recipe, re-check "
                                             "fraud reports against them, sign and publish the verdicts")
    add_bootstrap(p, "bootstrap peers (repeatable; default $MESHNET_BOOTSTRAP)")
    p.add_argument("--identity", metavar="FILE", help="the certifier's key file: signs the verdicts and fraud "
                                                      "reports (e.g. a bootstrap peer's, which clients trust; "
                                                      "default: this machine's, $XDG_CONFIG_HOME/meshnet-p2p/"
                                                      "identity.key)")
    p.add_argument("--model", help="GGUF model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--rounds", type=positive, default=1, help="review rounds, each published (default 1)")
    p.add_argument("--prompt", help="what every audited generation is given (default: drawn afresh for each, as "
                                    "users' prompts vary, so that a peer cannot tell an audit by its prompt)")
    p.add_argument("--prompts-file", metavar="PATH", help="draw the audited generations' prompts from this file's "
                                                          "lines (a sample of real traffic) instead")
    p.add_argument("--max-tokens", type=positive, help="tokens each audited generation makes (default: drawn "
                                                       "between 4 and 24 for each)")
    p.add_argument("--step-timeout", type=positive_float, default=10.0)
    p.add_argument("--no-own-replay", action="store_true",
                   help="replay audited hops only on other peers (by default a review whose --model is the whole "
                        "model replays each audited hop on it itself, where its build computes the hop's recipe: "
                        "a witness for every span, even one nobody else serves)")
    add_trust(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


MAX_PROMPTS = 100_000  # lines --prompts-file gives at most
MAX_PROMPT_CHARS = 4000


def read_prompts(path: str | None) -> list[str]:
    """The non-empty lines of ``--prompts-file`` (escaped newlines as in JSON: \\n), bounded;
    a missing or empty file is an error the operator sees."""
    from meshnet_p2p.core.errors import MeshnetError

    if path is None:
        return []
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.rstrip("\n").replace("\\n", "\n")[:MAX_PROMPT_CHARS] for _, line in zip(range(MAX_PROMPTS), f)]
    except (OSError, UnicodeDecodeError) as e:
        raise MeshnetError(f"cannot read --prompts-file {path}: {e}") from None
    prompts = [p for p in lines if p.strip()]
    if not prompts:
        raise MeshnetError(f"--prompts-file {path} has no prompt (one a line)")
    return prompts


def review_path(model_digest: str, certifier: str) -> str:
    """Where a certifier keeps its tally of one model's peers (not a client's records file)."""
    from meshnet_p2p.engine.models import cache_dir

    return os.path.join(cache_dir(), "records", f"review-{model_digest}-{certifier}.msgpack")


def storage_warning(held: "Stored", visible_networks: int) -> str:
    """As certify's storage_problem: too few networks hold the verdicts ("" if enough)."""
    from .certify import MIN_NETWORKS

    if held.networks >= min(MIN_NETWORKS, max(1, visible_networks)):
        return ""
    return (f"only {held.networks} network{'s' if held.networks != 1 else ''} of the {visible_networks} this node "
            f"sees hold the verdicts ({held.nodes} nodes): one operator there could hide them from readers; run "
            "review again later, or add bootstrap peers on other networks")


# --- the real network ----------------------------------------------------------------------------


def own_oracle(path: str, model_digest: str, me: str):
    """The certifier's own replayer when ``path`` is the whole model (verify/oracle.py), else None."""
    from meshnet_p2p.engine.cut import inspect_gguf
    from meshnet_p2p.verify.oracle import LocalOracle

    info = inspect_gguf(path)
    if info.is_cut or info.model_digest != model_digest:
        return None  # a shard is no witness for layers it does not hold
    return LocalOracle(path, model_digest, info.source_sha256, me)


def client_net(client: "Client", identity: "Identity", prompt: str | None, max_tokens: int | None,
               prompts: Sequence[str] = (), own_replay=None) -> ReviewNet:
    """The round's calls on the swarm, through ``client`` (a star client, ring=False). Each
    audit's prompt and length: ``prompt`` and ``max_tokens`` when given, else drawn
    (verify/review.py's audit_request, from ``prompts`` when given). ``own_replay``: the
    certifier's replay on its own weights (verify/oracle.py), for audits and re-checks."""
    import functools
    import random

    import trio

    from meshnet_p2p.verify.recheck import recheck_proof
    from meshnet_p2p.engine.contract import SamplingParams
    from meshnet_p2p.verify.reports import exchange_reports
    from meshnet_p2p.trust.verdicts import proof_of
    from .audit import generate_and_audit

    def spans() -> list:
        return trio.run(client.spans)

    rng = random.SystemRandom()  # nobody can predict the next audit's prompt from the last ones

    def audit(peer: str, exclude: set):
        drawn, n = audit_request(rng, prompts)
        return generate_and_audit(client, peer, prompt or drawn, max_tokens or n, exclude=exclude,
                                  own_replay=own_replay)[1]

    def fetch(peers: list) -> Mapping:
        return trio.run(functools.partial(exchange_reports, client.bootstrap, client.model_digest, (), peers))[0]

    def recheck(record, exclude: set):
        opts = client.route_options(1, SamplingParams(), False)  # the replays open sessions of their own
        return recheck_proof(proof_of(record), lambda: [s for s in spans() if s.peer_id not in exclude], opts,
                             measures=client.measures, verified=client.records.verified, own_replay=own_replay)

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
    from meshnet_p2p.verify.peer_records import PeerRecords
    from meshnet_p2p.core.records import wall_ms
    from .flags import model_path, required_seeds, signing_identity, trust_policy

    seeds = required_seeds(args)
    identity = signing_identity(args.identity)
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else (lambda m: print(m, flush=True))
    events = (lambda msg: print(f"[{sanitize(msg)}]", file=sys.stderr, flush=True))
    # its own key counts: the certifier's own certificates and earlier verdicts (the default key too)
    policy = trust_policy(args, seeds)
    trust = dataclasses.replace(policy, certifiers=policy.certifiers | {str(identity.peer_id)})
    client = Client(seeds, model_path=model_path(args.model), step_timeout=args.step_timeout, on_event=events,
                    trust=trust, ring=False)
    me = str(identity.peer_id)
    tally = PeerRecords(review_path(client.model_digest, me))
    oracle = None if args.no_own_replay else own_oracle(model_path(args.model), client.model_digest, me)
    net = client_net(client, identity, args.prompt, args.max_tokens, read_prompts(args.prompts_file),
                     own_replay=oracle.replay if oracle is not None else None)
    peers: dict[str, PeerOutcome] = {}
    heard = Heard()
    try:
        for n in range(1, args.rounds + 1):
            r = review_round(net, tally, identity, client.model_digest, now_ms=wall_ms, heard=heard,
                             log=events, storage_warning=storage_warning)
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
        if oracle is not None:
            oracle.close()
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
