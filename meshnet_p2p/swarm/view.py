"""What the swarm serves for one model, as this node sees it: the recipes its
peers announce, which of them this node holds certified, and which layers each
recipe covers. Pure functions of verified records and a trust policy; the
network call that fetches them (:func:`survey`) is passed nothing else.

Routing for user traffic takes only certified recipes
(:func:`routable_spans`); a dark recipe is routable for certification only.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable, Sequence

import trio

from .capability import model_key
from meshnet_p2p.trust.evidence import EvidenceRefused, cert_key, index_key
from meshnet_p2p.trust.policy import Certificate, TrustPolicy, certified
from meshnet_p2p.trust.verdicts import PEER_VERDICTS, PeerVerdicts, verdicts_key, verdicts_of
from meshnet_p2p.engine.recipe import explain_mismatch
from meshnet_p2p.core.errors import MeshnetError, unwrap_errors
from meshnet_p2p.core.identity import Identity, IdentityError, PeerId
from .placement import NoRoute, Span, missing_layers, plan_route
from meshnet_p2p.core.records import Record, keep_newest

MAX_CERTIFIERS = 16  # trusted certifiers whose certificates a survey looks up
# A survey that finds no report, or no trusted certificate for what is served, asks
# again: answers lost on a loaded host (sixteen clients starting at once) are not an
# empty swarm. Waits between tries (jittered) and the request timeout of each retry:
SURVEY_RETRY_WAITS_S = (0.25, 0.5, 1.0)
SURVEY_MAX_REQUEST_TIMEOUT_S = 2.0
CERTIFY_HINT = "meshnet-peer certify --bootstrap MULTIADDR --identity KEY_FILE_OF_A_TRUSTED_CERTIFIER"


class RecipeNotCertified(NoRoute):
    """Peers serve the model, but not under a recipe this node holds certified."""

    def __init__(self, message: str, missing: list[tuple[int, int]]) -> None:
        MeshnetError.__init__(self, message)
        self.missing = missing


@dataclass
class RecipeView:
    recipe_digest: str
    axes: dict[str, Any]
    labels: dict[str, Any]
    spans: list[Span]
    certificate: Certificate | None = None
    refused: list[tuple[str, EvidenceRefused]] = field(default_factory=list)

    @property
    def state(self) -> str:
        return "certified" if self.certificate is not None else "dark"

    def holes(self, n_layer: int) -> list[tuple[int, int]]:
        return missing_layers([s for s in self.spans if not s.departing], 0, n_layer)


@dataclass
class SwarmView:
    model_digest: str
    n_layer: int
    recipes: list[RecipeView]  # most peers first
    verdicts: list[PeerVerdicts] = field(default_factory=list)  # trusted certifiers' verdicts on peers

    def convicted(self) -> dict[str, str]:
        """Peers a trusted certifier convicted on a proof it re-checked: peer -> why (and by whom)."""
        return {p: f"convicted by certifier {v.certifier}: {why}" for v in self.verdicts
                for p, why in v.convicted.items()}

    def verified_by_certifiers(self) -> set[str]:
        """Peers a trusted certifier verified by its own audits (and none convicted)."""
        bad = self.convicted()
        return {p for v in self.verdicts for p in v.verified if p not in bad}

    def certified(self) -> list[RecipeView]:
        return [r for r in self.recipes if r.certificate is not None]

    def recipe(self, digest: str) -> RecipeView | None:
        return next((r for r in self.recipes if r.recipe_digest == digest), None)


def build_view(model_digest: str, n_layer: int | None, reports: Iterable[Record], certs: Iterable[Record],
               trust: TrustPolicy) -> SwarmView:
    """``n_layer`` None: not known here (a digest given alone); then the accepted
    certificates', else the layers the reports reach."""
    reports = list(reports)
    groups: dict[str, RecipeView] = {}
    for rec in reports:
        c = rec.content
        if c.get("model_digest") != model_digest:
            continue
        view = groups.get(c["recipe_digest"])
        if view is None:
            view = groups[c["recipe_digest"]] = RecipeView(c["recipe_digest"], {}, {}, [])
        if not view.axes and c.get("recipe"):  # reports' axes hash to their digest (capability._valid)
            view.axes, view.labels = dict(c["recipe"]), dict(c.get("recipe_labels") or {})
        view.spans.append(Span.from_report(rec))
    certs = list(certs)
    found_verdicts = verdicts_of(certs, trust.certifiers, model_digest)
    certs = [r for r in certs if r.payload_type != PEER_VERDICTS]
    refused: list[tuple[Record, EvidenceRefused]] = []
    held = certified(certs, trust, model_digest=model_digest, n_layer=n_layer, refused=refused)
    for digest, cert in held.items():
        if digest in groups:
            groups[digest].certificate = cert
    for rec, err in refused:
        view = groups.get(rec.content.get("recipe_digest"))
        if view is not None:
            view.refused.append((str(rec.signer), err))
    recipes = sorted(groups.values(), key=lambda v: (v.certificate is None, -len(v.spans), v.recipe_digest))
    if n_layer is None:
        n_layer = max((c.n_layer for c in held.values()), default=0) or max(
            (r.content["layers"][1] for r in reports), default=1)
    return SwarmView(model_digest, n_layer, recipes, found_verdicts)


def nearest_certified(view: SwarmView, dark: RecipeView) -> tuple[RecipeView, list[str]] | None:
    """The certified recipe that differs from ``dark`` on the fewest axes, and how."""
    best = None
    for cert in view.certified():
        reasons = explain_mismatch(cert.axes, dark.axes)
        if best is None or len(reasons) < len(best[1]):
            best = (cert, reasons)
    return best


def routable_spans(view: SwarmView, trust: TrustPolicy) -> list[Span]:
    """The spans of the certified recipe that can serve every layer (the one with
    most peers), or a typed error that says why there is none and what to do."""
    n = view.n_layer
    for r in view.certified():
        try:
            plan_route(r.spans, 0, n)
            return r.spans
        except NoRoute:
            continue
    if not view.recipes:
        raise NoRoute([(0, n)], "no peer announces this model")
    certified_views = view.certified()
    if certified_views:  # certified, but no certified route covers every layer
        best = certified_views[0]
        holes = best.holes(n)
        if not holes:
            raise NoRoute([(0, n)], f"every peer of certified recipe {best.recipe_digest[:12]} is full, departing "
                          "or failed recently")
        notes = [f"certified recipe {best.recipe_digest[:12]} is missing them"]
        for dark in view.recipes:
            if dark.certificate is None and not any(missing_layers(dark.spans, a, b) for a, b in holes):
                near = nearest_certified(view, dark)
                reasons = near[1] if near else []
                notes.append(f"peers of dark recipe {dark.recipe_digest[:12]} serve them, but it is not certified"
                             + (f" (it differs from certified {near[0].recipe_digest[:12]} on: {'; '.join(reasons)})"
                                if reasons else ""))
                break
        raise NoRoute(holes, "; ".join(notes))
    whole = [r for r in view.recipes if not r.holes(n)]
    top = whole[0] if whole else view.recipes[0]  # a dark recipe that could serve, if there is one
    lines = [f"recipe {top.recipe_digest[:12]} of model {view.model_digest[:12]} is dark: "
             f"this node holds no certificate for it from a certifier it trusts "
             f"({len(trust.certifiers)} trusted)"]
    why = sorted({f"{certifier}: {err.reason.value}" for certifier, err in top.refused})
    if why:
        lines.append("evidence seen and refused: " + ", ".join(why[:4]))
    lines.append(f"certify it with `{CERTIFY_HINT}`, or trust a certifier with --trust PEER_ID")
    holes = top.holes(n)
    if holes:  # nothing to certify yet: say what is missing first
        raise NoRoute(holes, "; ".join(lines))
    raise RecipeNotCertified("; ".join(lines), [(0, n)])


async def newest_signed_by(node, key: str, signer: str) -> Record | None:
    """The newest record under ``key`` that ``signer`` signed (gossip, then a
    lookup that also asks where the signer keeps its records: this node's
    bootstrap peers and the signer's own node, so nodes ground close to the key
    cannot hide it)."""
    try:
        homes = node.homes_of(PeerId.from_string(signer))
    except (IdentityError, ValueError):  # not a peer ID: no home to ask
        homes = []
    got = [r for r in [*node.records(key), *await node.get(key, also_ask=homes)] if str(r.signer) == signer]
    return max(got, key=lambda r: r.seq, default=None)


async def fetch_records(node, model_digest: str, certifiers: Iterable[str], *,
                        keep_departing: bool = False) -> tuple[list[Record], list[Record]]:
    """Capability reports of a model and the certificates that ``certifiers`` signed
    for the recipes its peers serve (and their peer verdicts), from a running DHT
    node (gossip, then lookups).
    Departing peers' reports are left out unless ``keep_departing`` (a monitor
    shows them leave); their recipes' certificates are not looked up either way.

    Each certifier has its own keys (its index of certified recipes, then one key
    per recipe), which only it can sign for: strangers can neither crowd them out
    nor make a reader check their evidence."""
    key = model_key(model_digest)
    # the bootstrap peers are asked directly too: they hold every report gossip brought them,
    # whatever group sits closest to the key in the lookups
    seeds = list(getattr(node, "seeds", ()))
    chosen = sorted(certifiers)[:MAX_CERTIFIERS]
    found: dict[bytes, Record] = {}
    indexes: dict[str, Record | None] = {}
    certs: list[Record] = []

    async def reports_() -> None:
        found.update(keep_newest({r.signer.multihash: r for r in node.records(key)},
                                 await (node.get(key, also_ask=seeds) if seeds else node.get(key))))

    async def verdicts_(certifier: str) -> None:  # its verdicts on the model's peers ride with its certificates
        verdicts = await newest_signed_by(node, verdicts_key(model_digest, certifier), certifier)
        if verdicts is not None:
            certs.append(verdicts)

    async def index_(certifier: str) -> None:
        indexes[certifier] = await newest_signed_by(node, index_key(model_digest, certifier), certifier)

    # Side by side: each lookup costs round trips across the internet, and only the
    # certificates wait for anything (the recipes both indexed and served)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(reports_)
        for certifier in chosen:
            nursery.start_soon(verdicts_, certifier)
            nursery.start_soon(index_, certifier)
    staying = [r for r in found.values() if not r.content.get("departing")]
    reports = list(found.values()) if keep_departing else staying
    served = {r.content["recipe_digest"] for r in staying}

    async def cert_(certifier: str, recipe: str) -> None:
        rec = await newest_signed_by(node, cert_key(model_digest, recipe, certifier), certifier)
        if rec is not None:
            certs.append(rec)

    async with trio.open_nursery() as nursery:
        for certifier in chosen:
            index = indexes.get(certifier)
            for d in (index.content["recipes"] if index else []):
                if d in served:
                    nursery.start_soon(cert_, certifier, d)
    return sorted(reports, key=lambda r: r.content["layers"][0]), certs


def worth_asking_again(reports: list[Record], certs: list[Record], trust: TrustPolicy, n_layer: int = 0, *,
                       need_certificate: bool = True) -> bool:
    """Did a survey come back too thin to believe at once: no report, reports that
    leave some of the model's ``n_layer`` layers unserved, or no certificate from
    any trusted certifier? Each is what lost answers look like; asked again, a live
    swarm answers."""
    spans = [Span.from_report(r) for r in reports if not r.content.get("departing")]
    return not spans or bool(missing_layers(spans, 0, n_layer)) or \
        (need_certificate and bool(trust.certifiers) and not certs)


async def fetch_believable(node, model_digest: str, trust: TrustPolicy, n_layer: int = 0, *,
                           need_certificate: bool = True) -> tuple[list[Record], list[Record]]:
    """:func:`fetch_records`, asked again (bounded, jittered, with a longer request
    timeout each time) while the answer is :func:`worth_asking_again` (``certify``
    needs no certificate yet: it makes one)."""
    reports, certs = await fetch_records(node, model_digest, trust.certifiers)
    for wait in SURVEY_RETRY_WAITS_S:
        if not worth_asking_again(reports, certs, trust, n_layer, need_certificate=need_certificate):
            break
        await trio.sleep(wait * (0.5 + random.random()))  # sixteen clients do not retry in step
        node.config.request_timeout = min(2 * node.config.request_timeout, SURVEY_MAX_REQUEST_TIMEOUT_S)
        more_reports, more_certs = await fetch_records(node, model_digest, trust.certifiers)
        reports = sorted(_merged(reports, more_reports), key=lambda r: r.content["layers"][0])
        certs = _merged(certs, more_certs)
    return reports, certs


def _merged(a: Iterable[Record], b: Iterable[Record]) -> list[Record]:
    """The newest record of each (signer, key) in ``a`` and ``b``."""
    newest: dict[tuple, Record] = {}
    for r in [*a, *b]:
        at = (r.signer.multihash, r.content.get("key"))
        if at not in newest or r.seq > newest[at].seq:
            newest[at] = r
    return list(newest.values())


async def survey(bootstrap: Sequence[Any], model_digest: str, n_layer: int, trust: TrustPolicy, *,
                 then: Callable[[Any, SwarmView], Awaitable[None]] | None = None) -> SwarmView:
    """A SwarmView from a short-lived client-mode DHT node. ``then(node, view)``: more the
    caller asks of the DHT about what the view shows, through the same node (a client's
    look-up of fraud reports against the peers it would plan: verify/reports.py)."""
    from .node import start_node

    with unwrap_errors():
        async with trio.open_nursery() as nursery:
            node = await start_node(nursery, Identity.generate(), bootstrap=bootstrap, client_mode=True)
            reports, certs = await fetch_believable(node, model_digest, trust, n_layer)
            view = build_view(model_digest, n_layer, reports, certs, trust)
            if then is not None:
                await then(node, view)
            nursery.cancel_scope.cancel()
    return view
