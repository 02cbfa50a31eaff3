"""``meshnet-peer certify``: take a dark recipe out of the dark, with evidence.

The certifier drives a real forward over a route of at least two distinct
peers that together cover every layer, asks each hop to sign what it computed,
and compares the route's tokens with

- its own whole-model run under the same recipe (``whole-model``: its own
  engine must derive the same recipe digest, so the build and CPU kernels
  match), or, when it cannot run the whole model here,
- a second route with no peer in common (``two-routes``).

Only identical tokens certify. The evidence (see :mod:`certification`) is
signed with the certifier's key and stored under ``cert/<model>/<recipe>`` in
the DHT, from where gossip spreads it: on the nodes closest to the key along
every disjoint lookup path and, directly, on the certifier's homes (its
bootstrap peers, its own node), where readers also ask; it reports how many
networks took it and warns when too few did. The DHT node that carries it uses a
fresh identity: the certifier's key may be a running bootstrap peer's, and two
DHT nodes must not share a peer ID.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import trio

from meshnet_p2p.trust.attestation import TOKENS_DOMAIN, CertificationError, ids_digest
from meshnet_p2p.trust.evidence import (
    MAX_HOPS,
    MAX_IDS,
    TWO_ROUTES,
    WHOLE_MODEL,
    Evidence,
    RouteRun,
    cert_key,
    index_key,
    sign_index,
)
from meshnet_p2p.trust.catalogue import Entry, catalogue_key, entries_of, name_problem, sign_catalogue, with_entry
from meshnet_p2p.trust.policy import TrustPolicy
from meshnet_p2p.client import RouteOptions
from meshnet_p2p.route.star import StarRoute
from meshnet_p2p.route.generation import generate
from meshnet_p2p.engine.contract import SamplingParams
from meshnet_p2p.engine.models import save_manifest
from meshnet_p2p.engine.recipe import explain_mismatch
from meshnet_p2p.core.errors import unwrap_errors
from meshnet_p2p.dht.node import Stored
from meshnet_p2p.dht.routing import node_id_of
from meshnet_p2p.core.netgroup import networks
from meshnet_p2p.core.identity import Identity, PeerId
from meshnet_p2p.swarm.node import start_node
from meshnet_p2p.swarm.placement import NoRoute, Span, plan_route
from meshnet_p2p.core.records import wall_ms
from meshnet_p2p.swarm.view import RecipeView, build_view, fetch_believable, newest_signed_by

DEFAULT_PROMPT = "The capital of France is"
DEFAULT_TOKENS = 16
METHOD_CHOICES = ("auto", WHOLE_MODEL, TWO_ROUTES)


@dataclass
class CertifyOptions:
    bootstrap: list
    identity: Identity  # signs the evidence
    model_path: str
    recipe: str | None = None  # a recipe digest (or a prefix); default: the dark recipe most peers serve
    method: str = "auto"
    prompt: str = DEFAULT_PROMPT
    max_tokens: int = DEFAULT_TOKENS
    step_timeout: float = 10.0
    threads: int | None = None
    name: str | None = None  # the name this model is listed under in the certifier's catalogue (default: its file's)


def certification_planner(exclude: set[str]):
    """plan_route over peers that each serve part of the model (so a route has
    at least two), leaving out ``exclude`` (the other route's peers)."""

    def plan(spans: Sequence[Span], start: int, end: int, **kw) -> list[Span]:
        partial = [s for s in spans if s.peer_id not in exclude and not (s.start == 0 and s.end == end)]
        route = plan_route(partial, start, end, **kw)
        if len(route) > MAX_HOPS:
            raise CertificationError(f"the route has {len(route)} hops; evidence holds at most {MAX_HOPS}")
        return route

    return plan


def run_route(spans: list[Span], n_layer: int, prompt: list[int], max_tokens: int, *, step_timeout: float,
              exclude: set[str] = frozenset(), log: Callable[[str], None] = lambda m: None) -> RouteRun:
    """One attested greedy generation through a route of the given spans, no failover."""
    opts = RouteOptions(max_tokens=len(prompt) + max_tokens, sampling=SamplingParams(), step_timeout=step_timeout,
                        max_failovers=0, on_event=log, planner=certification_planner(set(exclude)), attest=True)
    session = StarRoute.open(lambda: spans, n_layer, opts)
    try:
        run = generate(session, prompt, max_tokens, stop_at_eog=False)
        return RouteRun(run.steps, run.token_ids, session.attestations(), session.session_id)
    finally:
        session.close()


def whole_model_reference(opts: CertifyOptions, view: RecipeView, source_sha256: str, prompt: list[int]
                          ) -> tuple[list[int] | None, str]:
    """The certifier's own tokens from the whole model under the recipe's settings,
    or (None, why not): another build or CPU path derives another recipe digest."""
    from meshnet_p2p.route.local import LocalRoute

    n_ubatch = int(view.axes.get("n_ubatch", 0) or 0)
    seam = str(view.axes.get("seam_dtype", ""))
    if n_ubatch <= 0 or not seam:
        return None, "the peers' reports do not state n_ubatch and seam_dtype"
    from meshnet_p2p.engine.cut import inspect_gguf

    from .progress import TerminalProgress

    info = inspect_gguf(opts.model_path, source_sha256=source_sha256)
    progress = TerminalProgress("the whole model")
    route = LocalRoute.from_model(opts.model_path, [(0, info.source_layers)], source_sha256=source_sha256,
                                  n_ubatch=n_ubatch, seam_dtype=seam, max_sessions=1,
                                  n_ctx_per_session=len(prompt) + opts.max_tokens + 8, n_threads=opts.threads,
                                  progress=progress)
    try:
        mine = route.caps[0]
        if mine.recipe_digest != view.recipe_digest:
            axes = explain_mismatch(dict(mine.recipe), view.axes) or ["an axis this build does not know"]
            return None, "this machine runs another recipe: " + "; ".join(axes)
        done = iter(range(1, opts.max_tokens + 1))
        return route.generate(prompt, opts.max_tokens, SamplingParams(), stop_at_eog=False,
                              on_token=lambda _: progress("tokens", next(done), opts.max_tokens)).token_ids, ""
    finally:
        route.close()


def choose_recipe(views: list[RecipeView], wanted: str | None, n_layer: int) -> RecipeView:
    if wanted:
        matches = [v for v in views if v.recipe_digest.startswith(wanted.lower())]
        if len(matches) != 1:
            raise CertificationError(f"{len(matches)} recipes in the swarm match {wanted!r}"
                                     + (f"; there are: {', '.join(v.recipe_digest[:12] for v in views)}" if views else ""))
        return matches[0]
    candidates = [v for v in views if not v.holes(n_layer)]
    if not candidates:
        if not views:
            raise NoRoute([(0, n_layer)], "no peer announces this model")
        holes = views[0].holes(n_layer)
        raise NoRoute(holes, f"recipe {views[0].recipe_digest[:12]} does not cover every layer, so it cannot be certified")
    dark = [v for v in candidates if v.certificate is None]
    return (dark or candidates)[0]


def run(args) -> int:
    """The ``certify`` command: progress on stdout, or with --json on stderr and the summary on stdout."""
    import json
    import sys

    from .flags import model_path, print_line, required_seeds, signing_identity

    seeds = required_seeds(args)
    opts = CertifyOptions(bootstrap=seeds, identity=signing_identity(args.identity),
                          model_path=model_path(args.model), recipe=args.recipe, method=args.method,
                          prompt=args.prompt or DEFAULT_PROMPT, max_tokens=args.max_tokens,
                          step_timeout=args.step_timeout, name=args.name)
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else print_line
    summary = trio.run(certify, opts, log)
    if args.json:
        print(json.dumps(summary))
    return 0


async def certify(opts: CertifyOptions, log: Callable[[str], None] = print) -> dict:
    """Certify one recipe of the model in the swarm; returns a summary."""
    from meshnet_p2p.engine.cut import inspect_gguf
    from meshnet_p2p.engine.manifest import build_manifest
    from meshnet_p2p.engine.tokenizer import Tokenizer
    from .progress import TerminalProgress

    name = opts.name or default_name(opts.model_path)
    if (why := name_problem(name)) is not None:
        raise CertificationError(f"--name {name!r}: {why}")
    # the manifest's one pass over the file also gives its sha256
    progress = TerminalProgress("the model")
    manifest = await trio.to_thread.run_sync(lambda: build_manifest(opts.model_path, lambda _, d, t: progress("hashing", d, t)))
    source_sha = manifest.source_sha256
    info = await trio.to_thread.run_sync(lambda: inspect_gguf(opts.model_path, source_sha256=source_sha))
    n_layer, model = info.source_layers, info.model_digest
    prompt = Tokenizer(opts.model_path).encode(opts.prompt)
    if not prompt:
        raise CertificationError("the certification prompt is empty")
    if len(prompt) > MAX_IDS or opts.max_tokens > MAX_IDS:  # evidence carries both: refuse before running
        raise CertificationError(f"the prompt ({len(prompt)} tokens) and --max-tokens ({opts.max_tokens}) must each "
                                 f"be at most {MAX_IDS}")
    own = TrustPolicy.default(own=opts.identity)
    with unwrap_errors():
        async with trio.open_nursery() as nursery:
            node = await start_node(nursery, Identity.generate(), bootstrap=opts.bootstrap, client_mode=True)
            # a survey too thin to believe (answers lost on a loaded host) is asked again
            reports, certs = await fetch_believable(node, model, own, n_layer, need_certificate=False)
            view = choose_recipe(build_view(model, n_layer, reports, certs, own).recipes, opts.recipe, n_layer)
            log(f"certifying recipe {view.recipe_digest[:12]} of model {model[:12]} ({len(view.spans)} peers)")
            summary = await _certify_recipe(opts, view, info, source_sha, prompt, log)
            wire = summary.pop("evidence")
            me = str(opts.identity.peer_id)
            homes = await certifier_homes(node, opts.identity.peer_id)
            stored = await node.publish(cert_key(model, view.recipe_digest, me), wire, also=homes)
            # this certifier's index of the model's recipes it certified: this one first
            index = await newest_signed_by(node, index_key(model, me), me)
            before = index.content["recipes"] if index else []
            indexed = await node.publish(index_key(model, me), sign_index(opts.identity, model,
                                                                         [view.recipe_digest, *before], now_ms=wall_ms()),
                                         also=homes)
            # and its catalogue: this name for this file (its manifest's digest), first
            listed = await newest_signed_by(node, catalogue_key(me), me)
            entry = Entry(name, model, manifest.digest(), manifest.file_size)
            entries = with_entry(entries_of(listed) if listed else [], entry)
            named = await node.publish(catalogue_key(me), sign_catalogue(opts.identity, entries, now_ms=wall_ms()),
                                       also=homes)
            visible = networks([*node.table.contacts(), *homes])
            nursery.cancel_scope.cancel()
    # all three must reach readers
    held = Stored(min(stored.nodes, indexed.nodes, named.nodes), min(stored.networks, indexed.networks, named.networks))
    save_manifest(manifest)  # for this machine's peers to serve
    summary["name"] = name
    summary["manifest_digest"] = entry.manifest_digest
    summary["stored_on"] = held.nodes
    summary["stored_networks"] = held.networks
    problem = storage_problem(held, visible)
    if held.nodes == 0:
        raise CertificationError(f"recipe {view.recipe_digest[:12]} passed, but {problem}; run certify again")
    log(f"certified recipe {view.recipe_digest[:12]} by {summary['method']}; evidence stored on {held.nodes} nodes "
        f"in {held.networks} network{'s' if held.networks != 1 else ''}")
    if problem:
        summary["warning"] = problem
        log(f"warning: {problem}")
    return summary


def default_name(path: str) -> str:
    """A model's name from its file, as clients name it: "SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct"."""
    import os

    return os.path.basename(path).split(".")[0]


MIN_NETWORKS = 3  # distinct networks that should hold a certifier's records


async def certifier_homes(node, certifier: PeerId) -> list:
    """Where the certifier's records are stored besides the nodes closest to
    their keys: the bootstrap peers, and the certifier's own node if it runs
    one (a bootstrap operator certifies with the bootstrap's key), found by a
    lookup of its ID. Readers ask the same places (swarm_view.newest_signed_by)."""
    await node.find_node(node_id_of(certifier))  # a node that answers under that ID enters the table
    return node.homes_of(certifier)


def storage_problem(held: Stored, visible_networks: int) -> str:
    """Why the records may not reach readers ("" if held widely enough): nodes
    in one network, one operator's, may all be one colluding group. The bar is
    what this node can see: a swarm on one LAN or one host has one network."""
    if held.nodes == 0:
        return "no node took the evidence"
    want = min(MIN_NETWORKS, max(1, visible_networks))
    if held.networks >= want:
        return ""
    return (f"only {held.networks} network{'s' if held.networks != 1 else ''} of the {visible_networks} this node "
            f"sees hold the evidence ({held.nodes} nodes): one operator there could hide it from readers; run "
            f"certify again later, or add bootstrap peers on other networks")


async def _certify_recipe(opts: CertifyOptions, view: RecipeView, info, source_sha: str, prompt: list[int],
                          log: Callable[[str], None]) -> dict:
    n_layer = info.source_layers
    method, reference, why_not = opts.method, None, ""
    if method in ("auto", WHOLE_MODEL):
        if info.is_cut:
            why_not = f"{opts.model_path} is a shard, not the whole model"
        else:
            log("running the whole model here under the same recipe ...")
            reference, why_not = await trio.to_thread.run_sync(whole_model_reference, opts, view, source_sha, prompt)
        if reference is None:
            if method == WHOLE_MODEL:
                raise CertificationError(f"cannot certify by a whole-model run: {why_not}")
            log(f"no whole-model run here ({why_not}); comparing two routes with no peer in common")
        method = WHOLE_MODEL if reference is not None else TWO_ROUTES

    def route(exclude: set[str]) -> RouteRun:
        return run_route(view.spans, n_layer, prompt, opts.max_tokens, step_timeout=opts.step_timeout,
                         exclude=exclude, log=log)

    try:
        first = await trio.to_thread.run_sync(route, set())
        routes = [first]
        if method == TWO_ROUTES:
            routes.append(await trio.to_thread.run_sync(route, {h.peer_id for h in first.hops}))
    except NoRoute as e:
        raise CertificationError(f"no certification route: {e}") from None
    for r in routes:
        log("route: " + " -> ".join(f"{h.start}:{h.end}@{h.peer_id[-8:]}" for h in sorted(r.hops, key=lambda h: h.start)))
    expected = reference if method == WHOLE_MODEL else routes[0].generated
    for r in routes:
        if r.generated != expected:
            first_diff = next((i for i, (a, b) in enumerate(zip(r.generated, expected)) if a != b), min(len(r.generated), len(expected)))
            raise CertificationError(f"the route's tokens differ from the reference from token {first_diff} on: "
                                     f"recipe {view.recipe_digest[:12]} is not certified")
    evidence = Evidence(view.spans[0].record.content["model_digest"], view.recipe_digest, n_layer, method,
                        tuple(prompt), tuple(routes), ids_digest(TOKENS_DOMAIN, expected), view.axes, view.labels)
    wire = evidence.sign(opts.identity, now_ms=wall_ms())
    return {"model_digest": evidence.model_digest, "recipe_digest": view.recipe_digest, "method": method,
            "certifier": str(opts.identity.peer_id), "token_ids": list(expected),
            "routes": [[{"peer_id": h.peer_id, "layers": [h.start, h.end]} for h in sorted(r.hops, key=lambda h: h.start)]
                       for r in routes],
            "evidence": wire}
