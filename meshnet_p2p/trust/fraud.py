"""What a proven mismatch carries (pure: no network, no signatures yet).

An audit (client/audit.py) replays a hop's recorded steps on other peers of
the same certified recipe; honest peers compute bit-identical outputs, so when
two independent replays agree with each other and not with the audited peer,
the peer computed something else. :class:`FraudProof` holds what a later DHT
record will carry so that anyone with the weights can check it by replay: who,
on which model, recipe and layers, in which session, at which step, the digest
of what the peer answered and of what the replays answered, who replayed, and
(for a head hop, whose inputs are token ids: small) every step's tokens up to
the one that differs. Hidden-state inputs are too large to carry; a proof for
a later hop names its step and digests only.

:func:`output_digest` is how a step's output is compared: sha256 over its
position and its bytes exactly (a hidden state's tensors by name, dtype, shape
and data; a tail's token and end-of-generation flag).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.engine.contract import SamplingParams, TensorBundle

from .commitment import Commitment, CommitmentError, hidden_digest, token_digest

FRAUD_PROOF = "meshnet/fraud-proof/v1"

MAX_PROOF_STEPS = 512  # steps whose inputs a proof carries (a head's prompt chunks and decode tokens)
MAX_PROOF_TOKENS = 8192  # token ids over all those steps
MAX_REPLAYERS = 24  # two replay chains of at most 12 hops each
MAX_ID_CHARS = 128  # a peer id or session id
MAX_POSITION = 1 << 31
MAX_LAYERS = 100_000
_HEX64 = re.compile(r"[0-9a-f]{64}")
_SESSION = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class FraudProofError(MeshnetError):
    """A fraud proof that is malformed or out of bounds."""


def output_digest(position: int, output: object) -> str:
    """The digest of one step's output, the very digest its hop's commitment signs:
    a TensorBundle (a hidden state at ``position``), or a tail's reply (anything with
    ``token_id`` and ``is_eog``; at the reply's ``position``, where the token is fed
    back, when it has one)."""
    if isinstance(output, TensorBundle):
        return hidden_digest(position, output).hex()
    token, eog = getattr(output, "token_id", None), getattr(output, "is_eog", None)
    if not isinstance(token, int) or not isinstance(eog, bool):
        raise TypeError(f"a step's output is a TensorBundle or a token reply, not {type(output).__name__}")
    at = getattr(output, "position", position)
    return token_digest(at if isinstance(at, int) else position, token, eog).hex()


@dataclass(frozen=True)
class InputStep:
    """One step a head hop was given: its first position, its token ids, whether a decode step."""

    position: int
    token_ids: tuple[int, ...]
    decode: bool


@dataclass(frozen=True)
class FraudProof:
    peer_id: str  # the audited peer
    model_digest: str
    recipe_digest: str
    start: int
    end: int
    session_id: str  # the audited hop's session
    step: int  # index of the first step whose output differs
    position: int  # that step's first position
    peer_output: str  # output_digest of what the peer answered there
    replay_output: str  # output_digest of what both replays answered there
    replayers: tuple[str, ...]  # every peer that replayed (both chains)
    sampling: SamplingParams = SamplingParams()  # a tail's token depends on it
    inputs: tuple[InputStep, ...] = ()  # a head's: every step up to and including ``step``; else empty
    commitment: Commitment | None = None  # the peer's signed commitment to that step, when it sent one

    def __post_init__(self) -> None:
        _check(self)

    def signed_by_peer(self) -> bool:
        """Whether the peer itself signed the output the replays contradict: what makes
        the proof stand against it for anyone who re-checks the replay (~0.12 ms)."""
        c = self.commitment
        return c is not None and c.output_digest.hex() == self.peer_output and c.verifies()

    def to_content(self) -> dict[str, Any]:
        s = self.sampling
        return {"type": FRAUD_PROOF, "peer_id": self.peer_id, "model_digest": self.model_digest,
                "recipe_digest": self.recipe_digest, "layers": [self.start, self.end], "session": self.session_id,
                "step": self.step, "position": self.position, "peer_output": self.peer_output,
                "replay_output": self.replay_output, "replayers": list(self.replayers),
                "sampling": {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "seed": s.seed},
                "inputs": [[i.position, list(i.token_ids), i.decode] for i in self.inputs],
                "commitment": self.commitment.to_content() if self.commitment is not None else None}

    @classmethod
    def from_content(cls, c: Mapping[str, Any]) -> "FraudProof":
        """Parse content from anyone: every field typed and bounded, else FraudProofError."""
        try:
            if not isinstance(c, Mapping) or c.get("type") != FRAUD_PROOF:
                raise FraudProofError(f"not a {FRAUD_PROOF} record")
            layers, sampling = c["layers"], c["sampling"]
            if not isinstance(layers, list) or len(layers) != 2 or not isinstance(sampling, Mapping):
                raise FraudProofError("malformed layers or sampling")
            replayers, inputs = c["replayers"], c["inputs"]
            if not isinstance(replayers, list) or len(replayers) > MAX_REPLAYERS:
                raise FraudProofError("malformed replayers")
            if not isinstance(inputs, list) or len(inputs) > MAX_PROOF_STEPS:
                raise FraudProofError("malformed inputs")
            steps = []
            for item in inputs:
                if not (isinstance(item, list) and len(item) == 3 and isinstance(item[1], list)
                        and len(item[1]) <= MAX_PROOF_TOKENS):
                    raise FraudProofError("malformed input step")
                steps.append(InputStep(_int(item[0]), tuple(_int(t) for t in item[1]), _bool(item[2])))
            return cls(_str(c["peer_id"]), _str(c["model_digest"]), _str(c["recipe_digest"]), _int(layers[0]),
                       _int(layers[1]), _str(c["session"]), _int(c["step"]), _int(c["position"]),
                       _str(c["peer_output"]), _str(c["replay_output"]), tuple(_str(r) for r in replayers),
                       SamplingParams(_float(sampling["temperature"]), _int(sampling["top_k"]),
                                      _float(sampling["top_p"]), _int(sampling["seed"])),
                       tuple(steps), _commitment(c.get("commitment")))
        except KeyError as e:
            raise FraudProofError(f"a fraud proof lacks {e}") from None
        except ValueError as e:  # SamplingParams refuses out-of-range values this way
            raise FraudProofError(f"malformed fraud proof: {e}") from None


def _commitment(x) -> Commitment | None:
    if x is None:
        return None
    try:
        return Commitment.from_content(x)
    except CommitmentError as e:
        raise FraudProofError(f"malformed commitment: {e}") from None


def _int(x) -> int:
    if type(x) is not int:
        raise FraudProofError(f"expected an integer, got {type(x).__name__}")
    return x


def _bool(x) -> bool:
    if type(x) is not bool:
        raise FraudProofError(f"expected a boolean, got {type(x).__name__}")
    return x


def _float(x) -> float:
    if type(x) not in (int, float):
        raise FraudProofError(f"expected a number, got {type(x).__name__}")
    try:
        return float(x)
    except OverflowError:  # an integer no float holds (not from msgpack, but content may come from anywhere)
        raise FraudProofError("a number out of range") from None


def _str(x) -> str:
    if type(x) is not str or len(x) > MAX_ID_CHARS:
        raise FraudProofError("expected a string of at most 128 characters")
    return x


def _check(p: FraudProof) -> None:
    for name in ("model_digest", "recipe_digest", "peer_output", "replay_output"):
        if not isinstance(getattr(p, name), str) or not _HEX64.fullmatch(getattr(p, name)):
            raise FraudProofError(f"{name} is not a sha256 hex digest")
    if p.peer_output == p.replay_output:
        raise FraudProofError("a fraud proof needs outputs that differ")
    for peer in (p.peer_id, *p.replayers):
        if not isinstance(peer, str) or not 0 < len(peer) <= MAX_ID_CHARS or not peer.isprintable():
            raise FraudProofError("a peer id is empty, too long or unprintable")
    if not p.replayers or len(p.replayers) > MAX_REPLAYERS or p.peer_id in p.replayers:
        raise FraudProofError("a fraud proof names 1..24 replayers, not the audited peer")
    if not isinstance(p.session_id, str) or not _SESSION.fullmatch(p.session_id):
        raise FraudProofError("malformed session id")
    if not (0 <= p.start < p.end <= MAX_LAYERS):
        raise FraudProofError(f"bad layers {p.start}:{p.end}")
    if not (0 <= p.step < MAX_POSITION and 0 <= p.position < MAX_POSITION):
        raise FraudProofError("step or position out of range")
    c = p.commitment
    if c is not None and (c.peer_id, c.session_id, c.model_digest, c.recipe_digest, c.start, c.end, c.index) != \
            (p.peer_id, p.session_id, p.model_digest, p.recipe_digest, p.start, p.end, p.step):
        raise FraudProofError("the commitment is not the audited peer's for that session, span and step")
    if p.inputs:
        if p.start != 0:
            raise FraudProofError("only a head hop's proof carries its inputs (token ids)")
        if len(p.inputs) != p.step + 1 or len(p.inputs) > MAX_PROOF_STEPS:
            raise FraudProofError("a proof's inputs are every step up to the one that differs")
        if sum(len(i.token_ids) for i in p.inputs) > MAX_PROOF_TOKENS:
            raise FraudProofError(f"a proof carries at most {MAX_PROOF_TOKENS} token ids")
        at = 0  # a session's steps start at position 0
        for i in p.inputs:
            if i.position != at or not i.token_ids or any(not 0 <= t < 1 << 32 for t in i.token_ids):
                raise FraudProofError("a proof's input steps are contiguous, non-empty, 32-bit token ids")
            if i.decode and len(i.token_ids) != 1:
                raise FraudProofError("a decode step carries one token")
            at += len(i.token_ids)
        if p.inputs[-1].position != p.position:
            raise FraudProofError("the last input step is the one that differs")
