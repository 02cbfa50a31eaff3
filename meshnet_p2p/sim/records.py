"""The records a simulated swarm's peers sign: capability reports and certificates.

Each model has one recipe (its axes made up, their digest real) and N_LAYER
layers, served in slices. A certifier (a bootstrap operator, with the
bootstrap's key, as ``certify`` is run) signs whole-model evidence for each
model's recipe from a route of three stand-in hops, and its index of them: the
same record types, checks and keys a real certifier's carry, so every node
verifies them as it would the real ones (``check_evidence`` included).
"""

from __future__ import annotations

from meshnet_p2p.core.identity import Identity
from meshnet_p2p.core.multiaddr import Multiaddr
from meshnet_p2p.engine.recipe import RECIPE_AXES, recipe_digest
from meshnet_p2p.swarm.capability import CapabilityReport
from meshnet_p2p.testing import FAKE_CERT_PEM
from meshnet_p2p.trust.attestation import TOKENS_DOMAIN, Attestation, ids_digest
from meshnet_p2p.trust.evidence import WHOLE_MODEL, Evidence, RouteRun, expected_digests, sign_index

N_LAYER = 30
SLICES = ((0, 10), (10, 20), (20, 30))  # what volunteers serve with --placement slices (the certified route too)
PROMPT = (11, 12, 13)
STEPS = ((0, 3, 21), (3, 1, 22), (4, 1, 23))  # a prefill, then two decodes
GENERATED = [21, 22, 23]


def recipe_axes(model: str) -> dict:
    axes = {a: "sim" for a in RECIPE_AXES}
    axes.update(tokenizer_digest=model, flash_attn=False, n_ubatch=64, boundary_schema_version=1,
                protocol_schema_version=1)
    return axes


def recipe_of(model: str) -> str:
    return recipe_digest(recipe_axes(model))


def report(identity: Identity, model: str, layers: tuple[int, int], *, ip: str, port: int, throughput: float,
           now_ms: int) -> bytes:
    """A volunteer's signed capability report, as ``join`` announces it."""
    addr = str(Multiaddr.for_socket(ip, "tcp", port, identity.peer_id))
    return CapabilityReport(model, recipe_of(model), tuple(layers), (addr,), throughput=throughput,
                            free_sessions=4, tls_cert=FAKE_CERT_PEM).sign(identity, seq=now_ms, now_ms=now_ms)


def certificate(certifier: Identity, model: str, hops: list[Identity], *, now_ms: int) -> bytes:
    """Whole-model evidence for ``model``'s recipe over a route of ``hops`` (one per slice)."""
    recipe = recipe_of(model)
    run = RouteRun([list(s) for s in STEPS], list(GENERATED), [], "sim")
    head_in, tail_out = expected_digests(PROMPT, run)
    seams = [head_in] + [f"{i:02x}" * 32 for i in range(1, len(SLICES))] + [tail_out]
    for i, (ident, (a, b)) in enumerate(zip(hops, SLICES)):
        att = Attestation(str(ident.peer_id), f"sim-{i}", model, recipe, a, b, len(STEPS), seams[i], seams[i + 1])
        run.hops.append(att.signed_by(ident))
    ev = Evidence(model, recipe, N_LAYER, WHOLE_MODEL, PROMPT, (run,), ids_digest(TOKENS_DOMAIN, GENERATED),
                  recipe_axes(model), {"recipe_name": "sim"})
    return ev.sign(certifier, now_ms=now_ms)


def index(certifier: Identity, model: str, *, now_ms: int) -> bytes:
    return sign_index(certifier, model, [recipe_of(model)], now_ms=now_ms)
