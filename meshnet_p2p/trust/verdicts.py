"""The records that carry verified compute through the DHT (issue 26, points 3-4).

- A **fraud report** (``fraud/<model>/<peer>``, one per reporter): a
  transferable :class:`~.fraud_proof.FraudProof` against ``peer``, signed by whoever
  found it. Nodes store and gossip only reports whose proof is well formed
  and carries the accused peer's own signature on the output it contradicts
  (so nobody can report a peer that never served them), bounded per key, per
  signer and per source like every record (dht/storage.py, the store rate
  per source). A report is a claim: a node acts on it only after its own
  replays confirm it (verify/recheck.py).
- A certifier's **peer verdicts** (``verdicts/<model>/<certifier>``, only it
  may sign there): the peers it verified by its own audits, with how many
  sessions, and the peers it convicted on a proof it re-checked. A node that
  trusts the certifier (trust/policy.py, the trust of certification) counts
  the first as verified and leaves the second out; everyone else ignores it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from meshnet_p2p.core.identity import Identity
from meshnet_p2p.core.records import PayloadType, Record, canonical, never_raising, sign_record

from .fraud_proof import FraudProof, FraudProofError

FRAUD_REPORT = "meshnet/fraud-report/v1"
PEER_VERDICTS = "meshnet/peer-verdicts/v1"
RECORD_TTL_MS = 24 * 3600 * 1000  # the longest a record may live: a reporter or certifier puts it again
MAX_VERIFIED = 128  # peers one verdicts record names as verified
MAX_CONVICTED = 64  # and as convicted
MAX_WHY_CHARS = 200
MAX_ID_CHARS = 128
MAX_CONTENT_BYTES = 15 * 1024  # either record's, packed: one DHT record (16 KiB) with its envelope
_HEX64 = re.compile(r"[0-9a-f]{64}")


def report_key(model_digest: str, peer_id: str) -> str:
    return f"fraud/{model_digest}/{peer_id}"


def verdicts_key(model_digest: str, certifier: str) -> str:
    return f"verdicts/{model_digest}/{certifier}"


def model_of_key(key: str) -> str | None:
    """The model a report or verdicts key names, or None."""
    parts = key.split("/")
    if len(parts) == 3 and parts[0] in ("fraud", "verdicts") and _HEX64.fullmatch(parts[1]):
        return parts[1]
    return None


# --- fraud reports -------------------------------------------------------------------------------


def sign_report(identity: Identity, proof: FraudProof, *, now_ms: int, ttl_ms: int = RECORD_TTL_MS) -> bytes:
    """A report of ``proof``, signed by ``identity`` (FraudProofError if the proof is not
    transferable, or too large for a record: nodes would refuse it)."""
    why = proof.transferable()
    if why is not None:
        raise FraudProofError(f"a proof others cannot check is not reported: {why}")
    content = {"key": report_key(proof.model_digest, proof.peer_id), "reporter": str(identity.peer_id),
               "proof": proof.to_content()}
    if len(canonical(content)) > MAX_CONTENT_BYTES:  # a proof of peer-ID replayers always fits (trust/fraud_proof.py)
        raise FraudProofError(f"the report would exceed {MAX_CONTENT_BYTES} bytes")
    return sign_record(identity, FRAUD_REPORT, content, seq=now_ms, now_ms=now_ms, ttl_ms=ttl_ms)


def proof_of(record: Record) -> FraudProof:
    """The proof a verified report record carries (FraudProofError if it is not one)."""
    if record.payload_type != FRAUD_REPORT:
        raise FraudProofError(f"a {record.payload_type} record is not a fraud report")
    return FraudProof.from_content(record.content.get("proof"))


def _valid_report(c: Mapping[str, Any]) -> str | None:
    try:
        proof = FraudProof.from_content(c.get("proof"))
    except FraudProofError as e:
        return str(e)
    if c.get("key") != report_key(proof.model_digest, proof.peer_id):
        return "key must be fraud/<model digest>/<accused peer>"
    if not isinstance(c.get("reporter"), str) or set(c) != {"key", "reporter", "proof"}:
        return "a report names its key, reporter and proof only"
    if c["reporter"] == proof.peer_id:  # it would only ever be a shield (issue 59): it carries nothing
        return "a peer does not report itself"
    return proof.transferable()


FRAUD_REPORT_TYPE = PayloadType(FRAUD_REPORT, max_payload_bytes=MAX_CONTENT_BYTES, claimed_peer_field="reporter",
                                replay_key_field="key", validate=never_raising(_valid_report))


# --- a certifier's verdicts ----------------------------------------------------------------------


@dataclass(frozen=True)
class PeerVerdicts:
    """What one certifier says of a model's peers: verified (peer -> sessions), convicted (peer -> why)."""

    certifier: str
    model_digest: str
    verified: Mapping[str, int]
    convicted: Mapping[str, str]
    issued_at_ms: int = 0


def sign_verdicts(identity: Identity, model_digest: str, verified: Mapping[str, int], convicted: Mapping[str, str],
                  *, now_ms: int, ttl_ms: int = RECORD_TTL_MS) -> bytes:
    """``identity``'s verdicts on a model's peers: the convicted, then the most-verified, as
    many of each as the bounds and one record (MAX_CONTENT_BYTES) hold."""
    best = sorted(((p, n) for p, n in verified.items() if n > 0 and p not in convicted), key=lambda x: (-x[1], x[0]))
    content = {"key": verdicts_key(model_digest, str(identity.peer_id)), "certifier": str(identity.peer_id),
               "model_digest": model_digest, "verified": [], "convicted": []}
    room = MAX_CONTENT_BYTES - len(canonical(content)) - 4  # each list's header grows by 2 bytes past 15 entries
    for name, items, bound in (("convicted", [[p, why[:MAX_WHY_CHARS]] for p, why in sorted(convicted.items())],
                                MAX_CONVICTED),
                               ("verified", [[p, min(n, 1 << 31)] for p, n in best], MAX_VERIFIED)):
        for e in items[:bound]:
            room -= len(canonical(e))
            if room < 0:
                break
            content[name].append(e)
    return sign_record(identity, PEER_VERDICTS, content, seq=now_ms, now_ms=now_ms, ttl_ms=ttl_ms)


def _valid_verdicts(c: Mapping[str, Any]) -> str | None:
    if set(c) != {"key", "certifier", "model_digest", "verified", "convicted"}:
        return "a verdicts record names its key, certifier, model, verified and convicted peers only"
    model, certifier, verified, convicted = c["model_digest"], c["certifier"], c["verified"], c["convicted"]
    if not (isinstance(model, str) and _HEX64.fullmatch(model) and isinstance(certifier, str)
            and c.get("key") == verdicts_key(model, certifier)):
        return "key must be verdicts/<model digest>/<certifier>"

    def entries(x, bound: int, second) -> bool:
        return isinstance(x, list) and len(x) <= bound and all(
            isinstance(e, list) and len(e) == 2 and type(e[0]) is str and 0 < len(e[0]) <= MAX_ID_CHARS
            and second(e[1]) for e in x) and len({e[0] for e in x}) == len(x)

    if not entries(verified, MAX_VERIFIED, lambda n: type(n) is int and 0 < n <= 1 << 31):
        return f"verified is at most {MAX_VERIFIED} distinct [peer, sessions] pairs"
    if not entries(convicted, MAX_CONVICTED, lambda w: type(w) is str and len(w) <= MAX_WHY_CHARS):
        return f"convicted is at most {MAX_CONVICTED} distinct [peer, why] pairs"
    if {e[0] for e in verified} & {e[0] for e in convicted}:
        return "a peer is not both verified and convicted"
    return None


PEER_VERDICTS_TYPE = PayloadType(PEER_VERDICTS, max_payload_bytes=MAX_CONTENT_BYTES, claimed_peer_field="certifier",
                                 replay_key_field="key", validate=never_raising(_valid_verdicts))

TYPES = {FRAUD_REPORT: FRAUD_REPORT_TYPE, PEER_VERDICTS: PEER_VERDICTS_TYPE}


def verdicts_of(records: Iterable[Record], trusted: Iterable[str], model_digest: str) -> list[PeerVerdicts]:
    """The newest verdicts of each trusted certifier for ``model_digest`` among verified ``records``."""
    trusted = set(trusted)
    newest: dict[str, Record] = {}
    for r in records:
        c = r.content
        if r.payload_type != PEER_VERDICTS or c.get("model_digest") != model_digest or str(r.signer) not in trusted \
                or c.get("certifier") != str(r.signer) or _valid_verdicts(c) is not None:
            continue
        if c["certifier"] not in newest or r.seq > newest[c["certifier"]].seq:
            newest[c["certifier"]] = r
    return [PeerVerdicts(p, model_digest, {e[0]: e[1] for e in r.content["verified"]},
                         {e[0]: e[1] for e in r.content["convicted"]}, r.issued_at_ms) for p, r in sorted(newest.items())]
