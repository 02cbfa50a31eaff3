"""What a hop attests about what it computed in one session: running
digests of the rows it took in and gave out (:class:`RowDigest`), and the
statement it signs (:class:`Attestation`). The data plane keeps these
(dataplane/session_state.py, servicer.py) and the client checks them; the
certification evidence that carries them is :mod:`.evidence`.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from meshnet_p2p.engine.contract import TensorBundle
from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.core.identity import Identity, signed_by_peer
from meshnet_p2p.core.records import canonical

ATTEST_DOMAIN = b"meshnet-hop-attestation-v1\0"
# what crosses a boundary: one hop's output digest is the next hop's input digest, so one domain
SEAM_DOMAIN = b"meshnet-seam-v1\0"
PROMPT_DOMAIN = b"meshnet-prompt-v1\0"
TOKENS_DOMAIN = b"meshnet-generated-v1\0"


class CertificationError(MeshnetError):
    """Anything certification refuses (the trust package's error)."""


def frame_tokens(h, position: int, ids: Sequence[int]) -> None:
    """One step's token ids into a running sha256 (every digest of a step frames them so)."""
    h.update(struct.pack("<cQI", b"T", position, len(ids)))
    h.update(struct.pack(f"<{len(ids)}I", *ids))


def frame_hidden(h, position: int, bundle: TensorBundle) -> None:
    """One step's hidden-state bundle into a running sha256: each tensor's name, dtype, shape and bytes."""
    h.update(struct.pack("<cQI", b"H", position, len(bundle.tensors)))
    for t in sorted(bundle.tensors, key=lambda t: t.name):
        h.update(t.name.encode() + b"\0" + t.dtype.encode() + b"\0")
        h.update(struct.pack(f"<I{len(t.shape)}Q", len(t.shape), *t.shape))
        h.update(t.data)


class RowDigest:
    """A running sha256 over the steps a hop took in (or gave out), one frame per
    step: its position, and its token ids or hidden-state bytes. The peer and
    the client each keep one per hop; they must agree."""

    def __init__(self, domain: bytes) -> None:
        self._h = hashlib.sha256(domain)

    def tokens(self, position: int, ids: Sequence[int]) -> None:
        frame_tokens(self._h, position, ids)

    def token(self, position: int, token_id: int) -> None:
        self._h.update(struct.pack("<cQI", b"O", position, token_id))

    def hidden(self, position: int, bundle: TensorBundle) -> None:
        frame_hidden(self._h, position, bundle)

    def rollback(self, position: int) -> None:
        """A rewind is part of the record too: work after it is not the same work."""
        self._h.update(struct.pack("<cQ", b"R", position))

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def ids_digest(domain: bytes, ids: Sequence[int]) -> str:
    return hashlib.sha256(domain + struct.pack(f"<{len(ids)}I", *ids)).hexdigest()


class PeerSigned:
    """A statement a peer signs about its own work (``peer_id``, ``signature``): an
    attestation, a step commitment. Subclasses say what the signature covers."""

    refused = CertificationError  # raised when an identity signs a statement that names another peer
    noun = "statement"

    def signed_message(self) -> bytes:
        raise NotImplementedError

    def signed_by(self, identity: Identity):
        if str(identity.peer_id) != self.peer_id:
            raise self.refused(f"{self.noun} is signed by the peer it names")
        return replace(self, signature=identity.sign(self.signed_message()))

    def verifies(self) -> bool:
        return signed_by_peer(self.peer_id, self.signature, self.signed_message())


@dataclass(frozen=True)
class Attestation(PeerSigned):
    """A hop's signed statement of what it computed in one session."""

    peer_id: str
    session_id: str
    model_digest: str
    recipe_digest: str
    start: int
    end: int
    steps: int
    input_digest: str
    output_digest: str
    signature: bytes = b""

    def signed_bytes(self) -> bytes:
        return ATTEST_DOMAIN + canonical([self.peer_id, self.session_id, self.model_digest, self.recipe_digest,
                                          self.start, self.end, self.steps, self.input_digest, self.output_digest])

    noun = "an attestation"

    def signed_message(self) -> bytes:
        return self.signed_bytes()

    def to_content(self) -> dict[str, Any]:
        return {"peer_id": self.peer_id, "session": self.session_id, "model_digest": self.model_digest,
                "recipe_digest": self.recipe_digest, "layers": [self.start, self.end], "steps": self.steps,
                "input_digest": self.input_digest, "output_digest": self.output_digest, "signature": self.signature}

    @classmethod
    def from_content(cls, c: Mapping[str, Any]) -> "Attestation":
        layers = c["layers"]
        return cls(c["peer_id"], c["session"], c["model_digest"], c["recipe_digest"], layers[0], layers[1],
                   c["steps"], c["input_digest"], c["output_digest"], c["signature"])
