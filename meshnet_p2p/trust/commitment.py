"""A hop's signed commitment to one step it computed (issue 26, point 1).

For every step a session applies, the peer signs what it took in and what it
gave out, bound to the session, the route epoch and the position, and chained
to the commitment before it in the session (``prev``). The client gets it
with the step's reply (a star) or copy (a ring), and a ring hop forwards it
with the step's output: the next hop takes the step only if what it got is
what the commitment names, so a hop that forwards one thing and copies the
client another is caught on the spot, and blamed on its own signature.

Digests: one frame per step, as :class:`~.attestation.RowDigest` frames it
(the position, then token ids or hidden-state bytes), under a domain of its
own. A hidden bundle digests alike whether it goes out of one hop or into the
next (that is what a ring compares); the tail's token is digested with its
is_eog flag at the position it is fed to the head at (the session's position
after the step).

Rollback: the chain resumes from the last commitment whose step ended at or
before the position rolled back to (``index`` and ``prev`` as they were
then), so the steps that survive a rollback form one unbroken chain, as the
client's own record of them does (it drops the same steps). The commitments
dropped stay signed: a replayed step at the same position comes on a newer
route epoch, so the two do not equivocate.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, fields
from typing import Any, Mapping, Sequence

import msgpack

from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.engine.contract import TensorBundle

from .attestation import PeerSigned, frame_hidden, frame_tokens

COMMIT_DOMAIN = b"meshnet-step-commitment-v1\0"  # what is signed (link())
STEP_IO_DOMAIN = b"meshnet-step-io-v1\0"  # one step's input or output
DIGEST_BYTES = 32
SIGNATURE_BYTES = 64
GENESIS = bytes(DIGEST_BYTES)  # the prev of a session's first commitment
MAX_ID_CHARS = 128  # peer and session IDs, as sessions and records bound them
MAX_DIGEST_CHARS = 128  # model and recipe digests (hex sha256: 64)
MAX_COUNT = 1 << 40  # layers, epochs, positions, indices


class CommitmentError(MeshnetError):
    """A commitment that is malformed or out of bounds (from the network or a record)."""


def hidden_digest(position: int, bundle: TensorBundle) -> bytes:
    """A hidden-state bundle at ``position``: a hop's output, and the next hop's input."""
    h = hashlib.sha256(STEP_IO_DOMAIN)
    frame_hidden(h, position, bundle)
    return h.digest()


def tokens_digest(position: int, ids: Sequence[int]) -> bytes:
    """Token ids a head takes at ``position`` (a prompt chunk, or one decode token)."""
    h = hashlib.sha256(STEP_IO_DOMAIN)
    frame_tokens(h, position, ids)
    return h.digest()


def token_digest(position: int, token_id: int, is_eog: bool) -> bytes:
    """The tail's sampled token, as fed to the head at ``position`` (the tail's position after the step)."""
    return hashlib.sha256(STEP_IO_DOMAIN + struct.pack("<cQI?", b"O", position, token_id, is_eog)).digest()


def input_digest(position: int, payload) -> bytes:
    """A step's input: a TensorBundle, or token ids."""
    return hidden_digest(position, payload) if isinstance(payload, TensorBundle) else tokens_digest(position, payload)


@dataclass(frozen=True)
class Commitment(PeerSigned):
    """One step a peer applied in one session, signed by that peer over :meth:`link`."""

    refused = CommitmentError
    noun = "a commitment"

    peer_id: str
    session_id: str
    model_digest: str
    recipe_digest: str
    start: int
    end: int
    route_epoch: int
    index: int  # 0-based: how many steps of this session's chain came before it
    position: int  # the step's first position
    decode: bool
    input_digest: bytes
    output_digest: bytes
    prev: bytes = GENESIS  # the previous commitment's link() in this session
    signature: bytes = b""

    def __post_init__(self) -> None:
        for name in ("peer_id", "session_id"):
            v = getattr(self, name)
            if not isinstance(v, str) or len(v) > MAX_ID_CHARS:
                raise CommitmentError(f"a commitment's {name} is a string of at most {MAX_ID_CHARS} characters")
        for name in ("model_digest", "recipe_digest"):
            v = getattr(self, name)
            if not isinstance(v, str) or len(v) > MAX_DIGEST_CHARS:
                raise CommitmentError(f"a commitment's {name} is a string of at most {MAX_DIGEST_CHARS} characters")
        for name in ("start", "end", "route_epoch", "index", "position"):
            v = getattr(self, name)
            if type(v) is not int or not 0 <= v < MAX_COUNT:
                raise CommitmentError(f"a commitment's {name} is an integer in [0, 2**40)")
        if type(self.decode) is not bool:
            raise CommitmentError("a commitment's decode is a boolean")
        for name in ("input_digest", "output_digest", "prev"):
            v = getattr(self, name)
            if not isinstance(v, bytes) or len(v) != DIGEST_BYTES:
                raise CommitmentError(f"a commitment's {name} is {DIGEST_BYTES} bytes")
        if not isinstance(self.signature, bytes) or len(self.signature) not in (0, SIGNATURE_BYTES):
            raise CommitmentError(f"a commitment's signature is {SIGNATURE_BYTES} bytes (or none yet)")

    def _body(self) -> list:
        return [getattr(self, name) for name in _BODY]

    def link(self) -> bytes:
        """What the signature covers, and the next commitment's ``prev``: the canonical
        msgpack of the body (flat: no maps to sort, so packed directly; on every step's
        path, where each Python call costs several times more than warm)."""
        return hashlib.sha256(COMMIT_DOMAIN + msgpack.packb(self._body(), use_bin_type=True)).digest()

    def signed_message(self) -> bytes:
        return self.link()

    def follows(self, before: "Commitment | None") -> bool:
        """Whether this is the next link of a chain whose last commitment is ``before`` (None: the first)."""
        if before is None:
            return self.index == 0 and self.prev == GENESIS
        return self.index == before.index + 1 and self.prev == before.link()

    def to_content(self) -> dict[str, Any]:
        """A msgpack-able map (bytes as bytes), for a record that carries it (a fraud proof)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_content(cls, c: Any) -> "Commitment":
        """The inverse of :meth:`to_content`, for content from anywhere: CommitmentError unless well-formed."""
        names = [f.name for f in fields(cls)]
        if not isinstance(c, Mapping) or set(c) != set(names):
            raise CommitmentError("a commitment's content names exactly its fields")
        return cls(**{n: c[n] for n in names})


_BODY = tuple(f.name for f in fields(Commitment) if f.name != "signature")  # what link() covers, in order
