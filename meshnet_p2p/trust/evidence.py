"""Certification evidence: a signed record that a recipe ran distributed and
gave the whole model's tokens, its check, and the certifier's index records.

A fingerprint (model digest + recipe digest) first seen in the swarm is
*dark*: visible, routable for certification only. It becomes *certified* for
a node when that node holds evidence that passes every check below, signed by
a certifier it trusts. There is no tracker: the evidence is a signed record
under ``cert/<model>/<recipe>`` in the DHT, spread by gossip, and every node
checks it itself.

What the evidence proves, and how it is checked (all pure functions here):

- each hop's peer signed an **attestation** of what it computed in the
  certification session: its range, the fingerprint it ran, how many steps,
  and running digests of its inputs and outputs (:class:`RowDigest`);
- the hops chain: hop i's output digest is hop i+1's input digest, the head's
  input is the prompt and the fed-back tokens, the tail's output is the
  tokens the evidence reports, so no hop's signature can be moved to another
  run;
- at least two distinct peers, none named twice, whose ranges tile every
  layer; at least one generated token;
- the route's tokens equal the certifier's own whole-model run under the same
  recipe (``whole-model``), or a second route with no peer in common
  (``two-routes``), and the certifier signed the whole record.

Whose evidence counts is each node's own policy (:mod:`.policy`); what a hop
attests is :mod:`.attestation`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Mapping, Sequence

from meshnet_p2p.engine.recipe import recipe_digest
from meshnet_p2p.core.identity import Identity, PeerId
from meshnet_p2p.core.records import PayloadType, sign_record
from .attestation import PROMPT_DOMAIN, SEAM_DOMAIN, TOKENS_DOMAIN, Attestation, CertificationError, RowDigest, ids_digest

CERTIFICATE = "meshnet/certificate/v1"
CERT_INDEX = "meshnet/certified-index/v1"  # which recipes of a model one certifier certified
CERTIFICATE_TTL_MS = 24 * 3600 * 1000  # the longest a record may live; certify again to renew

WHOLE_MODEL = "whole-model"
TWO_ROUTES = "two-routes"
METHODS = (WHOLE_MODEL, TWO_ROUTES)

MAX_IDS = 256  # prompt or generated tokens carried in evidence
MAX_STEPS = 512
MAX_HOPS = 12  # per route: two routes of 12 hops still fit one record
MAX_INDEXED = 32  # recipes one certifier's index names per model
MAX_LAYERS = 100_000
_HEX64 = re.compile(r"[0-9a-f]{64}")


class Refusal(str, Enum):
    """Why evidence does not certify. Each is tested."""

    MALFORMED = "malformed"
    ONE_NODE = "one-node"
    NODE_TWICE = "node-twice"
    COVERAGE_HOLE = "coverage-hole"
    NO_TOKENS = "no-tokens"
    DISAGREES = "disagrees"
    BAD_SIGNATURE = "bad-signature"
    OTHER_FINGERPRINT = "other-fingerprint"
    BROKEN_CHAIN = "broken-chain"
    UNTRUSTED = "untrusted-certifier"


class EvidenceRefused(CertificationError):
    def __init__(self, reason: Refusal, detail: str) -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"evidence refused ({reason.value}): {detail}")


def cert_key(model_digest: str, recipe_digest: str, certifier: str) -> str:
    """One key per certifier: only its signer may store there (the key names it),
    so nobody can crowd a trusted certifier's evidence out, and readers look up
    only the certifiers they trust."""
    return f"cert/{model_digest}/{recipe_digest}/{certifier}"


def index_key(model_digest: str, certifier: str) -> str:
    return f"certs/{model_digest}/{certifier}"



def model_of_key(key: str) -> str | None:
    """The model a certification key (:func:`cert_key`, :func:`index_key`) names, or None."""
    parts = key.split("/")
    if (parts[0] == "cert" and len(parts) == 4) or (parts[0] == "certs" and len(parts) == 3):
        return parts[1] if _HEX64.fullmatch(parts[1]) else None
    return None



# --- one certification run -------------------------------------------------------------------


@dataclass
class RouteRun:
    """What the certifier saw of one route: the steps it drove (position, rows,
    the tail's token), the tokens it kept, and each hop's attestation."""

    steps: list[tuple[int, int, int]]
    generated: list[int]
    hops: list[Attestation]
    session: str = ""  # the route's session (each hop attests its own hop session)

    def to_content(self) -> dict[str, Any]:
        return {"session": self.session or "route",
                "steps": [list(s) for s in self.steps], "generated": list(self.generated),
                "hops": [h.to_content() for h in self.hops]}


def expected_digests(prompt: Sequence[int], run: RouteRun) -> tuple[str, str]:
    """The head's input digest and the tail's output digest that ``run`` implies:
    the prompt, then each generated token fed back at the next position."""
    ids = list(prompt) + list(run.generated)
    head_in, tail_out = RowDigest(SEAM_DOMAIN), RowDigest(SEAM_DOMAIN)
    for position, rows, token in run.steps:
        head_in.tokens(position, ids[position : position + rows])
        tail_out.token(position + rows - 1, token)
    return head_in.hexdigest(), tail_out.hexdigest()


def generated_of(prompt_len: int, steps: Sequence[tuple[int, int, int]]) -> list[int]:
    """The tokens a run generated: the tail's token of the step that ends the
    prompt, and of every step after it."""
    return [tok for pos, rows, tok in steps if pos + rows >= prompt_len]


@dataclass(frozen=True)
class Evidence:
    model_digest: str
    recipe_digest: str
    n_layer: int
    method: str
    prompt: tuple[int, ...]
    routes: tuple[RouteRun, ...]
    reference_digest: str  # whole-model: the certifier's own run's tokens; two-routes: the first route's
    recipe: Mapping[str, Any] = field(default_factory=dict)
    recipe_labels: Mapping[str, Any] = field(default_factory=dict)

    def content(self, certifier: PeerId) -> dict[str, Any]:
        return {
            "key": cert_key(self.model_digest, self.recipe_digest, str(certifier)),
            "certifier": str(certifier),
            "model_digest": self.model_digest,
            "recipe_digest": self.recipe_digest,
            "n_layer": self.n_layer,
            "method": self.method,
            "prompt": list(self.prompt),
            "prompt_digest": ids_digest(PROMPT_DOMAIN, self.prompt),
            "routes": [r.to_content() for r in self.routes],
            "reference_digest": self.reference_digest,
            "recipe": dict(self.recipe),
            "recipe_labels": dict(self.recipe_labels),
        }

    def sign(self, identity: Identity, *, now_ms: int, ttl_ms: int = CERTIFICATE_TTL_MS) -> bytes:
        content = self.content(identity.peer_id)
        refusal = check_evidence(content)
        if refusal is not None:
            raise EvidenceRefused(*refusal)
        return sign_record(identity, CERTIFICATE, content, seq=now_ms, now_ms=now_ms, ttl_ms=ttl_ms)


# --- checking evidence -------------------------------------------------------------------


def _shape(c: Mapping[str, Any]) -> tuple[list[RouteRun], list[int]] | str:
    """The parsed routes and prompt, or why the content is malformed."""

    def hex64(x: Any) -> bool:
        return isinstance(x, str) and _HEX64.fullmatch(x) is not None

    def uint(x: Any, bound: int) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= bound

    def id_list(x: Any) -> bool:
        return isinstance(x, list) and len(x) <= MAX_IDS and all(uint(t, 2**32 - 1) for t in x)

    if not (hex64(c.get("model_digest")) and hex64(c.get("recipe_digest")) and hex64(c.get("reference_digest"))):
        return "model_digest, recipe_digest and reference_digest must be sha256 hex"
    if not isinstance(c.get("certifier"), str) or c.get("key") != cert_key(c["model_digest"], c["recipe_digest"],
                                                                              c["certifier"]):
        return "the record's key does not name its model, recipe and certifier"
    if not uint(c.get("n_layer"), MAX_LAYERS) or c["n_layer"] < 1:
        return "n_layer out of range"
    if c.get("method") not in METHODS:
        return f"method must be one of {', '.join(METHODS)}"
    if not id_list(c.get("prompt")) or not c["prompt"]:
        return "prompt must be 1..256 token ids"
    if c.get("prompt_digest") != ids_digest(PROMPT_DOMAIN, c["prompt"]):
        return "prompt_digest does not match the prompt"
    for name in ("recipe", "recipe_labels"):
        m = c.get(name, {})
        if not (isinstance(m, dict) and len(m) <= 32 and all(isinstance(v, (str, int, bool)) for v in m.values())):
            return f"{name} must be a small map of scalars"
    raw_routes = c.get("routes")
    if not isinstance(raw_routes, list) or not 1 <= len(raw_routes) <= 2:
        return "routes must hold one or two routes"
    routes = []
    try:
        for r in raw_routes:
            steps = r["steps"]
            if not (isinstance(steps, list) and 0 < len(steps) <= MAX_STEPS and all(
                    isinstance(s, list) and len(s) == 3 and uint(s[0], 2**32) and uint(s[1], 2**16) and s[1] >= 1
                    and uint(s[2], 2**32 - 1) for s in steps)):
                return "steps must be 1..512 [position, rows, token] triples"
            if not id_list(r["generated"]):
                return "generated must be at most 256 token ids"
            if not (isinstance(r["session"], str) and 0 < len(r["session"]) <= 128):
                return "a route names its session (1..128 chars)"
            hops = r["hops"]
            if not isinstance(hops, list) or not 0 < len(hops) <= MAX_HOPS:
                return f"a route has 1..{MAX_HOPS} hops"
            atts = []
            for h in hops:
                if not (isinstance(h, dict) and isinstance(h.get("peer_id"), str) and isinstance(h.get("session"), str)
                        and len(h["session"]) <= 128 and hex64(h.get("model_digest")) and hex64(h.get("recipe_digest"))
                        and isinstance(h.get("layers"), list) and len(h["layers"]) == 2
                        and all(uint(x, MAX_LAYERS) for x in h["layers"]) and h["layers"][0] < h["layers"][1]
                        and uint(h.get("steps"), 2**32) and hex64(h.get("input_digest"))
                        and hex64(h.get("output_digest")) and isinstance(h.get("signature"), bytes)):
                    return "a hop's attestation is malformed"
                atts.append(Attestation.from_content(h))
            routes.append(RouteRun([tuple(s) for s in steps], list(r["generated"]), atts, r["session"]))
    except (KeyError, TypeError):
        return "a route is missing fields"
    return routes, list(c["prompt"])


def _coverage_hole(hops: Sequence[Attestation], n_layer: int) -> str | None:
    at = 0
    for h in sorted(hops, key=lambda h: h.start):
        if h.start > at:
            return f"layers {at}-{h.start - 1} are computed by no hop"
        if h.start < at:
            return f"hops overlap at layer {h.start}"
        at = h.end
    if at < n_layer:
        return f"layers {at}-{n_layer - 1} are computed by no hop"
    if at > n_layer:
        return f"the hops claim {at} layers of a {n_layer}-layer model"
    return None


def _schedule_problem(run: RouteRun, prompt_len: int) -> str | None:
    """Why a route's steps are not a prefill of the whole prompt from position 0
    followed by one-token decodes of the tokens it generated, or None."""
    at = 0
    for position, rows, _ in run.steps:
        if position != at:
            return f"a step at position {position} does not follow on from {at}"
        if position < prompt_len and position + rows > prompt_len:
            return "a prefill step runs past the prompt"
        if position >= prompt_len and rows != 1:
            return "a decode step carries more than one token"
        at += rows
    if at < prompt_len:
        return "its steps never feed the whole prompt"
    if at > prompt_len + max(0, len(run.generated) - 1):
        return "its steps feed more tokens than it generated"
    return None


def check_evidence(c: Mapping[str, Any]) -> tuple[Refusal, str] | None:
    """Why this evidence content certifies nothing, or None if it holds. Checks
    everything but who the certifier is (that is the reader's trust policy)."""
    parsed = _shape(c)
    if isinstance(parsed, str):
        return Refusal.MALFORMED, parsed
    routes, prompt = parsed
    model, recipe, n_layer = c["model_digest"], c["recipe_digest"], c["n_layer"]
    if c["method"] == TWO_ROUTES and len(routes) != 2:
        return Refusal.MALFORMED, "two-routes evidence carries two routes"
    if c["method"] == WHOLE_MODEL and len(routes) != 1:
        return Refusal.MALFORMED, "whole-model evidence carries one route"
    try:
        axes_match = recipe_digest(c.get("recipe") or {}) == recipe
    except ValueError:
        axes_match = False
    if not axes_match:
        return Refusal.OTHER_FINGERPRINT, "the recipe axes it names do not hash to its recipe digest"
    if len(routes) == 2 and routes[0].session == routes[1].session:
        return Refusal.MALFORMED, "the two routes name one session"
    seen_across: set[str] = set()
    for n, run in enumerate(routes):
        if not run.generated:
            return Refusal.NO_TOKENS, f"route {n} generated no tokens"
        why = _schedule_problem(run, len(prompt))
        if why:
            return Refusal.BROKEN_CHAIN, f"route {n}: {why}"
        peers = [h.peer_id for h in run.hops]
        twice = sorted({p for p in peers if peers.count(p) > 1})
        if twice:
            return Refusal.NODE_TWICE, f"route {n} names {twice[0]} more than once"
        if len(set(peers)) < 2:
            return Refusal.ONE_NODE, f"route {n} comes from one node; a distributed forward needs at least two"
        hole = _coverage_hole(run.hops, n_layer)
        if hole:
            return Refusal.COVERAGE_HOLE, f"route {n}: {hole}"
        sessions = [h.session_id for h in run.hops]
        if len(set(sessions)) != len(sessions) or any(not sid or len(sid) > 128 for sid in sessions):
            return Refusal.MALFORMED, f"route {n}: each hop attests a session of its own"
        for h in run.hops:
            if (h.model_digest, h.recipe_digest) != (model, recipe):
                return Refusal.OTHER_FINGERPRINT, f"hop {h.peer_id} attests another fingerprint than the evidence names"
        for h in run.hops:
            if not h.verifies():
                return Refusal.BAD_SIGNATURE, f"hop {h.peer_id}'s attestation signature does not verify"
        if generated_of(len(prompt), run.steps) != run.generated:
            return Refusal.BROKEN_CHAIN, f"route {n}: its steps do not end in the tokens it reports"
        ordered = sorted(run.hops, key=lambda h: h.start)
        head_in, tail_out = expected_digests(prompt, run)
        if ordered[0].input_digest != head_in:
            return Refusal.BROKEN_CHAIN, f"route {n}: the head did not take this prompt and these tokens"
        if ordered[-1].output_digest != tail_out:
            return Refusal.BROKEN_CHAIN, f"route {n}: the tail did not emit these tokens"
        for a, b in zip(ordered, ordered[1:]):
            if a.output_digest != b.input_digest or a.steps != b.steps or a.steps != len(run.steps):
                return Refusal.BROKEN_CHAIN, f"route {n}: {b.peer_id} did not take what {a.peer_id} gave"
        if c["method"] == TWO_ROUTES:
            common = seen_across & set(peers)
            if common:
                return Refusal.NODE_TWICE, f"the two routes share peer {sorted(common)[0]}"
            seen_across |= set(peers)
    if c["method"] == WHOLE_MODEL and ids_digest(TOKENS_DOMAIN, routes[0].generated) != c["reference_digest"]:
        return Refusal.DISAGREES, "the route's tokens differ from the certifier's own whole-model run"
    if c["method"] == TWO_ROUTES:
        a, b = routes
        if a.generated != b.generated or ids_digest(TOKENS_DOMAIN, a.generated) != c["reference_digest"]:
            return Refusal.DISAGREES, "the two routes generated different tokens"
    return None


def _validate(content: Mapping[str, Any]) -> str | None:
    """For the DHT: a node stores and gossips only evidence that checks out."""
    refusal = check_evidence(content)
    return None if refusal is None else f"{refusal[0].value}: {refusal[1]}"


CERTIFICATE_TYPE = PayloadType(CERTIFICATE, max_payload_bytes=15 * 1024, claimed_peer_field="certifier",
                               replay_key_field="key", validate=_validate)


def _valid_index(c: Mapping[str, Any]) -> str | None:
    try:
        recipes = c["recipes"]
        if not (isinstance(c["model_digest"], str) and isinstance(c["certifier"], str)
                and c["key"] == index_key(c["model_digest"], c["certifier"])):
            return "key must be certs/<model digest>/<certifier>"
        if not (_HEX64.fullmatch(c["model_digest"]) and isinstance(recipes, list) and len(recipes) <= MAX_INDEXED
                and all(isinstance(r, str) and _HEX64.fullmatch(r) for r in recipes)):
            return f"recipes must be at most {MAX_INDEXED} recipe digests"
    except (KeyError, TypeError):
        return "missing or mistyped fields"
    return None


CERT_INDEX_TYPE = PayloadType(CERT_INDEX, max_payload_bytes=4096, claimed_peer_field="certifier",
                              replay_key_field="key", validate=_valid_index)


def sign_index(identity: Identity, model_digest: str, recipes: Sequence[str], *, now_ms: int,
               ttl_ms: int = CERTIFICATE_TTL_MS) -> bytes:
    """The certifier's list of the recipes of a model it certified (newest first)."""
    content = {"key": index_key(model_digest, str(identity.peer_id)), "certifier": str(identity.peer_id),
               "model_digest": model_digest, "recipes": list(dict.fromkeys(recipes))[:MAX_INDEXED]}
    return sign_record(identity, CERT_INDEX, content, seq=now_ms, now_ms=now_ms, ttl_ms=ttl_ms)
