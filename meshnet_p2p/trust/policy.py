"""Whose certification evidence this node accepts (:class:`TrustPolicy`: by
default its bootstrap peers' keys and its own), and what a verified
certificate record grants it (:func:`evaluate`, :func:`certified`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from meshnet_p2p.core.identity import Identity, IdentityError, PeerId
from meshnet_p2p.core.records import Record
from .attestation import CertificationError
from .evidence import CERTIFICATE, EvidenceRefused, Refusal, check_evidence


@dataclass(frozen=True)
class TrustPolicy:
    """The certifiers whose evidence this node accepts (peer ID strings)."""

    certifiers: frozenset[str] = frozenset()

    @classmethod
    def default(cls, bootstrap: Iterable[Any] = (), *, own: PeerId | Identity | None = None,
                extra: Iterable[str] = (), trust_file: str | None = None) -> "TrustPolicy":
        """Its bootstrap peers' keys (from their multiaddrs), its own, ``--trust``
        peer IDs and a trust file's (one peer ID a line, ``#`` comments)."""
        out: set[str] = set()
        for b in bootstrap:
            peer = getattr(b, "peer_id", None)
            if peer is None and isinstance(b, str):
                from meshnet_p2p.core.multiaddr import Multiaddr

                peer = Multiaddr.parse(b).peer_id
            if peer is not None:
                out.add(str(peer))
        if own is not None:
            out.add(str(own.peer_id if isinstance(own, Identity) else own))
        texts = list(extra)
        if trust_file:
            try:
                with open(trust_file) as f:
                    texts += [line.split("#", 1)[0].strip() for line in f]
            except OSError as e:
                raise CertificationError(f"cannot read trust file {trust_file}: {e.strerror or e}") from None
        for text in filter(None, texts):
            try:
                out.add(str(PeerId.from_string(text)))
            except IdentityError as e:
                raise CertificationError(f"--trust {text[:60]!r} is not a peer ID: {e}") from None
        return cls(frozenset(out))

    def trusts(self, peer_id: str) -> bool:
        return peer_id in self.certifiers


@dataclass(frozen=True)
class Certificate:
    """A recipe certified for this node: by whom, how, on which route."""

    model_digest: str
    recipe_digest: str
    certifier: str
    method: str
    issued_at_ms: int
    route: tuple[tuple[str, int, int], ...]  # (peer, start, end) of the first route
    n_layer: int = 0
    expires_at_ms: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"certifier": self.certifier, "method": self.method, "issued_at_ms": self.issued_at_ms,
                "expires_at_ms": self.expires_at_ms,
                "route": [{"peer_id": p, "layers": [a, b]} for p, a, b in self.route]}


def evaluate(record: Record, trust: TrustPolicy, *, model_digest: str, n_layer: int | None = None) -> Certificate:
    """A verified certificate record -> the Certificate it grants this node, or
    :class:`EvidenceRefused` with the reason."""
    c = record.content
    if record.payload_type != CERTIFICATE:
        raise EvidenceRefused(Refusal.MALFORMED, f"a {record.payload_type} record is not evidence")
    certifier = c.get("certifier")
    if str(record.signer) != certifier:
        raise EvidenceRefused(Refusal.BAD_SIGNATURE, "the record is not signed by the certifier it names")
    if not trust.trusts(certifier):  # checked before the evidence: it costs nothing to check
        raise EvidenceRefused(Refusal.UNTRUSTED, f"certifier {certifier} is not one this node trusts "
                              "(add it with --trust PEER_ID or a trust file)")
    refusal = check_evidence(c)
    if refusal is not None:
        raise EvidenceRefused(*refusal)
    if c["model_digest"] != model_digest:
        raise EvidenceRefused(Refusal.OTHER_FINGERPRINT, "the evidence names another model")
    if n_layer is not None and c["n_layer"] != n_layer:
        raise EvidenceRefused(Refusal.OTHER_FINGERPRINT, f"the evidence is for {c['n_layer']} layers, the model has {n_layer}")
    hops = sorted(c["routes"][0]["hops"], key=lambda h: h["layers"][0])
    return Certificate(c["model_digest"], c["recipe_digest"], c["certifier"], c["method"], record.issued_at_ms,
                       tuple((h["peer_id"], h["layers"][0], h["layers"][1]) for h in hops), c["n_layer"],
                       record.expires_at_ms)


def certified(records: Iterable[Record], trust: TrustPolicy, *, model_digest: str, n_layer: int | None = None,
              refused: list[tuple[Record, EvidenceRefused]] | None = None) -> dict[str, Certificate]:
    """recipe digest -> the newest Certificate this node accepts for it. Refused
    evidence is appended to ``refused`` as (record, error) when given."""
    out: dict[str, Certificate] = {}
    for rec in records:
        try:
            cert = evaluate(rec, trust, model_digest=model_digest, n_layer=n_layer)
        except EvidenceRefused as e:
            if refused is not None:
                refused.append((rec, e))
            continue
        old = out.get(cert.recipe_digest)
        if old is None or cert.issued_at_ms > old.issued_at_ms:
            out[cert.recipe_digest] = cert
    return out
