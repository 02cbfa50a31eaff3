"""``meshnet-peer status``: what the swarm serves, as this node sees it.

Per model: its recipes with their state (dark, or certified and by whom, as
this node's trust policy decides), the layers each recipe covers with its
holes named, and its peers with their range, reachability (direct, or through
which relay), load and throughput (each peer's own measure, and a round trip
this command measures itself unless ``--no-probe``).

The survey (:func:`survey_node`, through any running DHT node) is shared with
``meshnet-peer monitor``, which keeps one node and surveys again and again.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

import trio

from meshnet_p2p.verify.peer_records import PeerRecord, load_records, records_path
from meshnet_p2p.swarm.capability import MODELS_KEY
from meshnet_p2p.trust.policy import TrustPolicy
from meshnet_p2p.core.errors import MeshnetError, sanitize, unwrap_errors
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.swarm.placement import Span
from meshnet_p2p.core.records import Record, keep_newest
from meshnet_p2p.swarm.relay_offers import RELAYS_KEY
from meshnet_p2p.swarm.view import RecipeView, SwarmView, build_view, fetch_records, newest_signed_by
from meshnet_p2p.trust import catalogue

MAX_MODELS = 32
PROBE_TIMEOUT_S = 3.0


def _ranges(pairs: Sequence[tuple[int, int]]) -> list[list[int]]:
    return [[a, b] for a, b in pairs]


def covered_ranges(spans: Sequence[Span]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s in sorted(spans, key=lambda s: s.start):
        if out and s.start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], s.end))
        else:
            out.append((s.start, s.end))
    return out


def probe(span: Span) -> float | None:
    """A Health round trip to the peer over the data plane, in ms, or None."""
    from meshnet_p2p.client import connect

    try:
        client = connect(span, PROBE_TIMEOUT_S)
    except MeshnetError:
        return None
    try:
        client.health()  # the first call also pays the TLS handshake
        t0 = time.perf_counter()
        client.health()
        return round((time.perf_counter() - t0) * 1000, 3)
    except MeshnetError:
        return None
    finally:
        client.close()


def recipe_doc(view: SwarmView, r: RecipeView, rtt: dict[str, float | None],
               records: dict[str, PeerRecord] | None = None) -> dict[str, Any]:
    """``records``: what this machine's clients verified of each peer (verify/peer_records.py); beside
    it, what trusted certifiers' signed verdicts say (verified by their audits, or convicted)."""
    cert = r.certificate
    vouched = ({p for p, _, _ in cert.route} if cert else set()) | view.verified_by_certifiers()
    convicted = view.convicted()
    records = records or {}
    peers = []
    for s in sorted(r.spans, key=lambda s: (s.start, s.peer_id)):
        c = s.record.content
        peers.append({
            "peer_id": s.peer_id, "name": c.get("name", ""), "layers": [s.start, s.end],
            "reachability": "direct" if c.get("direct", True) else f"relay {c.get('relay')}",
            "free_sessions": s.free_sessions, "kv_tokens_free": c.get("kv_tokens_free", 0),
            "throughput_reported": s.throughput, "rtt_ms": rtt.get(s.peer_id), "departing": s.departing,
            "record": {**(records.get(s.peer_id) or PeerRecord()).to_dict(s.peer_id in vouched),
                       "convicted": convicted.get(s.peer_id)},
        })
    return {
        "recipe_digest": r.recipe_digest, "state": r.state, "labels": r.labels, "axes": r.axes,
        "certified_by": cert.certifier if cert else None, "method": cert.method if cert else None,
        "certified_at_ms": cert.issued_at_ms if cert else None,
        "certificate_expires_at_ms": cert.expires_at_ms if cert else None,
        "coverage": {"covered": _ranges(covered_ranges(r.spans)), "holes": _ranges(r.holes(view.n_layer))},
        "refused_evidence": sorted({f"{who}: {err}" for who, err in r.refused}),
        "peers": peers,
    }


@dataclass
class Survey:
    """What one survey of the swarm found: the relays' records, and per model its name and view."""

    relays: list[Record]
    models: list[tuple[str, SwarmView]]
    catalogues: list[Record] = dataclasses.field(default_factory=list)  # trusted certifiers' names


async def indexed_models(node) -> list[tuple[str, str, int]]:
    """(digest, name, n_layer) of every model the swarm's index names, most announced first."""
    index = keep_newest({r.signer.multihash: r for r in node.records(MODELS_KEY)}, await node.get(MODELS_KEY))
    # the index is anyone's claim: a model's name and layer count are what most entries say
    votes: dict[str, Counter] = {}
    for rec in index.values():
        c = rec.content
        votes.setdefault(c["model_digest"], Counter())[(c["name"], c["n_layer"])] += 1
    ranked = sorted(votes.items(), key=lambda kv: -sum(kv[1].values()))[:MAX_MODELS]
    return [(digest, *count.most_common(1)[0][0]) for digest, count in ranked]


async def survey_node(node, trust: TrustPolicy, models: Sequence[tuple[str, str, int]] = (), *,
                      keep_departing: bool = False) -> Survey:
    """One survey through a running DHT node. ``keep_departing``: also the peers that
    announced their departure (a monitor shows them leave; routing and ``status`` do not)."""
    answered = node.stats["responses"]
    wanted = list(models) or await indexed_models(node)
    relays = keep_newest({r.signer.multihash: r for r in node.records(RELAYS_KEY)}, await node.get(RELAYS_KEY))
    views = []
    for digest, name, n_layer in wanted:
        reports, certs = await fetch_records(node, digest, trust.certifiers, keep_departing=keep_departing)
        views.append((name, build_view(digest, n_layer or None, reports, certs, trust)))
    if node.stats["responses"] == answered:  # no DHT node answered: cut off (a partition), not an empty swarm
        raise MeshnetError("no DHT peer answered the survey: this node is cut off from the swarm")
    catalogues = [r for c in sorted(trust.certifiers)
                  if (r := await newest_signed_by(node, catalogue.catalogue_key(c), c)) is not None]
    return Survey(list(relays.values()), views, catalogues)


def relay_doc(rec: Record) -> dict[str, Any]:
    """A relay's own record: where it is, what it allows, what it carries now (its claim)."""
    c = rec.content
    return {"peer_id": c["peer_id"], "addr": c["addr"], "limits": dict(c["limits"]), "load": dict(c["load"])}


def status_doc(survey: Survey, trust: TrustPolicy, rtt: dict[str, float | None]) -> dict[str, Any]:
    return {
        "relays": sorted((relay_doc(r) for r in survey.relays), key=lambda d: d["peer_id"]),
        "trusted_certifiers": sorted(trust.certifiers),
        # a name given to two files is listed with both (and "files": 2), never resolved to one
        "names": [{"name": name, "files": len(found),
                   "models": [{**n.entry.to_content(), "certified_by": list(n.certifiers)} for n in found]}
                  for name, found in catalogue.names(survey.catalogues, trust.certifiers).items()],
        "models": [{"model_digest": v.model_digest, "name": name, "n_layer": v.n_layer,
                    "recipes": [recipe_doc(v, r, rtt, load_records(records_path(v.model_digest)))
                                for r in v.recipes]} for name, v in survey.models],
    }


async def swarm_status(bootstrap: Sequence[Any], trust: TrustPolicy, models: Sequence[tuple[str, str, int]] = (),
                       *, probe_peers: bool = True) -> dict[str, Any]:
    """``models``: (digest, name, n_layer) to show; default: every model the swarm's index names."""
    from meshnet_p2p.swarm.node import start_node

    with unwrap_errors():
        async with trio.open_nursery() as nursery:
            node = await start_node(nursery, Identity.generate(), bootstrap=bootstrap, client_mode=True)
            survey = await survey_node(node, trust, models)
            nursery.cancel_scope.cancel()
    rtt: dict[str, float | None] = {}
    if probe_peers:
        spans = {s.peer_id: s for _, v in survey.models for r in v.recipes for s in r.spans}
        async with trio.open_nursery() as nursery:
            async def one(s: Span) -> None:
                rtt[s.peer_id] = await trio.to_thread.run_sync(probe, s)

            for s in spans.values():
                nursery.start_soon(one, s)
    return status_doc(survey, trust, rtt)


def run(args) -> int:
    """The ``status`` command: --model takes a GGUF path or a model digest (repeatable)."""
    import json
    import os
    import re

    from .flags import model_path, required_seeds, trust_policy

    seeds = required_seeds(args)
    models = []
    for m in args.model:
        if re.fullmatch(r"[0-9a-f]{64}", m):
            models.append((m, "", 0))
        else:
            from meshnet_p2p.engine.cut import inspect_gguf

            path = model_path(m)
            info = inspect_gguf(path)
            models.append((info.model_digest, os.path.basename(path).split(".")[0], info.source_layers))
    doc = trio.run(lambda: swarm_status(seeds, trust_policy(args, seeds), models, probe_peers=not args.no_probe))
    print(json.dumps(doc) if args.json else format_status(doc))
    return 0


def _record_text(rec: dict[str, Any]) -> str:
    """What this machine's clients know of a peer's computing (docs/verification.md)."""
    if rec["caught"]:
        return f"; CAUGHT computing something else: {sanitize(rec['caught'], 200)}"
    if rec.get("convicted"):
        return f"; CONVICTED: {sanitize(rec['convicted'], 200)}"
    parts = (["vouched"] if rec["vouched"] else []) + \
        ([f"{rec['verified_sessions']} sessions verified"] if rec["verified_sessions"] else [])
    return f"; {', '.join(parts)}" if parts else "; no verified record"


def format_status(doc: dict[str, Any]) -> str:
    lines = []
    for r in doc.get("relays", []):
        load, lim = r["load"], r["limits"]
        lines.append(f"relay {r['peer_id']} {r['addr']}: {load['reservations_now']}/{lim['max_reservations']} "
                     f"reservations, {load['circuits_now']} circuits now; {load['spliced']} spliced, "
                     f"{load['bytes']} bytes, {load['refused']} refused since start")
    for n in doc.get("names", []):
        for m in n["models"]:
            clash = f" (one of {n['files']} files under this name)" if n["files"] > 1 else ""
            lines.append(f"name {n['name']} -> model {m['model_digest'][:16]} manifest {m['manifest_digest'][:16]} "
                         f"({m['file_size']} bytes), named by {', '.join(m['certified_by'])}{clash}")
    if not doc["models"]:
        lines.append("no models found in the swarm")
    for m in doc["models"]:
        lines.append(f"model {m['name'] or '?'} {m['model_digest'][:16]} ({m['n_layer']} layers)")
        if not m["recipes"]:
            lines.append("  no peer serves it")
        for r in m["recipes"]:
            state = (f"certified by {r['certified_by']} ({r['method']})" if r["state"] == "certified" else "dark")
            holes = ", ".join(f"{a}-{b - 1}" for a, b in r["coverage"]["holes"]) or "none"
            label = "/".join(str(v) for v in r["labels"].values())
            lines.append(f"  recipe {r['recipe_digest'][:16]} {label}: {state}; holes: {holes}")
            for why in r["refused_evidence"][:4]:
                lines.append(f"    refused evidence: {why}")
            for p in r["peers"]:
                rtt = f"{p['rtt_ms']:.2f} ms" if p["rtt_ms"] is not None else "unreachable" if "rtt_ms" in p else "-"
                lines.append(f"    {p['layers'][0]:>4}-{p['layers'][1] - 1:<4} {p['peer_id']} {p['name']} "
                             f"[{p['reachability']}] free {p['free_sessions']} "
                             f"{p['throughput_reported']:.1f} tok/s reported, rtt {rtt}"
                             + (" (departing)" if p["departing"] else "") + _record_text(p["record"]))
    return "\n".join(lines)
