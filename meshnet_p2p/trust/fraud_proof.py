"""What a proven mismatch carries, and how anyone checks that it stands.

An audit (verify/replay.py) replays a hop's recorded steps on other peers of
the same certified recipe; honest peers compute bit-identical outputs, so when
two independent replays agree with each other and not with the audited peer,
the peer computed something else. :class:`FraudProof` is that finding in a
form anyone with the weights can check by replay (verify/recheck.py), whoever
made it:

- the peer's own signed commitment to the step that differs (``commitment``),
  whose output digest is what the replays contradict, and its commitments to
  every step before it (``chain``: the fields a session's links do not share),
  which the signed one binds through its ``prev`` hash chain: so the proof
  says, in the peer's own signature, what it was given at every step and what
  it answered;
- the route's token ids from position 0 to the end of that step (``tokens``):
  what a head was given, and what every later hop's input follows from. A
  re-checker feeds them through the layers before the peer's (on peers of the
  recipe) and must get exactly the input digests the peer signed, or the proof
  does not stand against the peer (its predecessor, or the reporter, lied);
  then replays the peer's layers and compares the outputs.

A proof that lacks any of these (a peer that signs nothing, a session too long
to carry) still tells the client that made it whom it caught, but it convinces
nobody else: :meth:`FraudProof.transferable` says why not.

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

from .commitment import (
    DIGEST_BYTES,
    GENESIS,
    Commitment,
    CommitmentError,
    hidden_digest,
    token_digest,
    tokens_digest,
)

FRAUD_PROOF = "meshnet/fraud-proof/v2"

# what a proof carries is bounded so that it fits one report record (15 KiB of content) whatever its fields
# hold, when it names its replayers by peer ID (tests/test_verdicts.py builds the largest): a link packs in
# at most 80 bytes, a token id in 5
MAX_PROOF_STEPS = 94  # steps up to and including the one that differs
MAX_PROOF_TOKENS = 1024  # the route's token ids up to the end of that step
MAX_REPLAYERS = 24  # two replay chains of at most 12 hops each
MAX_CUTS = 12  # hops before the peer's on its route
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
class ChainLink:
    """One earlier step's commitment, less the fields every link of a session shares."""

    route_epoch: int
    position: int
    decode: bool
    input_digest: bytes
    output_digest: bytes

    @classmethod
    def of(cls, c: Commitment) -> "ChainLink":
        return cls(c.route_epoch, c.position, c.decode, c.input_digest, c.output_digest)


@dataclass(frozen=True)
class FraudProof:
    peer_id: str  # the audited peer
    model_digest: str
    recipe_digest: str
    start: int
    end: int
    n_layer: int  # the model's: whether the hop is the tail (its output a sampled token)
    session_id: str  # the audited hop's session
    step: int  # index of the first step whose output differs
    position: int  # that step's first position
    peer_output: str  # output_digest of what the peer answered there
    replay_output: str  # output_digest of what both replays answered there
    replayers: tuple[str, ...]  # every peer that replayed (both chains)
    sampling: SamplingParams = SamplingParams()  # a tail's token depends on it
    max_tokens: int = 0  # KV positions the session reserved (a replay reserves as many)
    tokens: tuple[int, ...] = ()  # the route's token ids from position 0 to the end of ``step``
    chain: tuple[ChainLink, ...] = ()  # the peer's commitments to steps 0 .. step-1
    commitment: Commitment | None = None  # the peer's signed commitment to ``step``
    cuts: tuple[int, ...] = ()  # the first layers of the hops before the peer's on its route (seams round there)

    def __post_init__(self) -> None:
        _check(self)

    def signed_by_peer(self) -> bool:
        """Whether the peer itself signed the output the replays contradict (~0.12 ms)."""
        c = self.commitment
        return c is not None and c.output_digest.hex() == self.peer_output and c.verifies()

    def commitments(self) -> list[Commitment]:
        """The peer's commitments to steps 0 .. step, rebuilt from ``chain`` and linked by
        ``prev`` to the signed one (FraudProofError when they do not link or are missing)."""
        c = self.commitment
        if c is None or len(self.chain) != self.step:
            raise FraudProofError("the proof lacks the peer's commitments to every step up to the one that differs")
        out, prev = [], GENESIS
        for i, link in enumerate(self.chain):
            try:
                made = Commitment(c.peer_id, c.session_id, c.model_digest, c.recipe_digest, c.start, c.end,
                                  link.route_epoch, i, link.position, link.decode, link.input_digest,
                                  link.output_digest, prev)
            except CommitmentError as e:
                raise FraudProofError(f"chain link {i}: {e}") from None
            out.append(made)
            prev = made.link()
        if c.prev != prev:
            raise FraudProofError("the signed commitment does not chain to the links the proof carries")
        return [*out, c]

    def steps(self) -> list[tuple[int, tuple[int, ...], bool]]:
        """The route's steps 0 .. step as (position, token ids, decode), from the peer's
        commitments' positions and ``tokens`` (FraudProofError when they do not fit)."""
        cs = self.commitments()
        bounds = [c.position for c in cs] + [len(self.tokens)]
        if bounds[0] != 0:
            raise FraudProofError("the peer's session does not start at position 0")
        out = []
        for c, (a, b) in zip(cs, zip(bounds, bounds[1:])):
            if b <= a or (c.decode and b - a != 1):
                raise FraudProofError(f"the steps at position {a} do not fit the tokens the proof carries")
            out.append((a, tuple(self.tokens[a:b]), c.decode))
        return out

    def transferable(self) -> str | None:
        """Why this proof convinces nobody but the client that made it, or None when
        anyone can re-check it: the peer's signed commitments to every step up to
        the one that differs, linked, over the proof's tokens (a head's input
        digests are the tokens' own), and its signature on the contradicted output."""
        try:
            cs = self.commitments()
            steps = self.steps()
        except FraudProofError as e:
            return str(e)
        if len(self.tokens) > self.max_tokens:  # no session a replay opens as the peer's was could take them
            return f"the session reserved {self.max_tokens} positions, fewer than the proof's steps reach"
        if self.start == 0:
            for c, (position, ids, _) in zip(cs, steps):
                if c.input_digest != tokens_digest(position, ids):
                    return f"the head's signed input at position {position} is not the proof's tokens"
        if not self.signed_by_peer():
            return "the peer's signature does not cover the output the replays contradict"
        return None

    def to_content(self) -> dict[str, Any]:
        s = self.sampling
        return {"type": FRAUD_PROOF, "peer_id": self.peer_id, "model_digest": self.model_digest,
                "recipe_digest": self.recipe_digest, "layers": [self.start, self.end], "n_layer": self.n_layer,
                "session": self.session_id, "step": self.step, "position": self.position,
                "peer_output": self.peer_output, "replay_output": self.replay_output,
                "replayers": list(self.replayers),
                "sampling": {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "seed": s.seed},
                "max_tokens": self.max_tokens, "tokens": list(self.tokens),
                "chain": [[x.route_epoch, x.position, x.decode, x.input_digest, x.output_digest] for x in self.chain],
                "commitment": self.commitment.to_content() if self.commitment is not None else None,
                "cuts": list(self.cuts)}

    @classmethod
    def from_content(cls, c: Mapping[str, Any]) -> "FraudProof":
        """Parse content from anyone: every field typed and bounded, else FraudProofError."""
        try:
            if not isinstance(c, Mapping) or c.get("type") != FRAUD_PROOF:
                raise FraudProofError(f"not a {FRAUD_PROOF} record")
            layers, sampling = c["layers"], c["sampling"]
            if not isinstance(layers, list) or len(layers) != 2 or not isinstance(sampling, Mapping):
                raise FraudProofError("malformed layers or sampling")
            replayers, tokens, chain = c["replayers"], c["tokens"], c["chain"]
            if not isinstance(replayers, list) or len(replayers) > MAX_REPLAYERS:
                raise FraudProofError("malformed replayers")
            if not isinstance(tokens, list) or len(tokens) > MAX_PROOF_TOKENS:
                raise FraudProofError("malformed tokens")
            if not isinstance(chain, list) or len(chain) >= MAX_PROOF_STEPS:
                raise FraudProofError("malformed chain")
            links = []
            for item in chain:
                if not (isinstance(item, list) and len(item) == 5):
                    raise FraudProofError("malformed chain link")
                links.append(ChainLink(_int(item[0]), _int(item[1]), _bool(item[2]), _digest(item[3]),
                                       _digest(item[4])))
            return cls(_str(c["peer_id"]), _str(c["model_digest"]), _str(c["recipe_digest"]), _int(layers[0]),
                       _int(layers[1]), _int(c["n_layer"]), _str(c["session"]), _int(c["step"]),
                       _int(c["position"]), _str(c["peer_output"]), _str(c["replay_output"]),
                       tuple(_str(r) for r in replayers),
                       SamplingParams(_float(sampling["temperature"]), _int(sampling["top_k"]),
                                      _float(sampling["top_p"]), _int(sampling["seed"])),
                       _int(c["max_tokens"]), tuple(_int(t) for t in tokens), tuple(links),
                       _commitment(c.get("commitment")), _cuts(c["cuts"]))
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


def _cuts(x) -> tuple[int, ...]:
    if not isinstance(x, list) or len(x) > MAX_CUTS:
        raise FraudProofError(f"a proof names at most {MAX_CUTS} cuts")
    return tuple(_int(i) for i in x)


def _digest(x) -> bytes:
    if type(x) is not bytes or len(x) != DIGEST_BYTES:
        raise FraudProofError(f"expected a {DIGEST_BYTES}-byte digest")
    return x


def _int(x) -> int:
    if type(x) is not int:
        raise FraudProofError(f"expected an integer, got {type(x).__name__}")
    if not -(1 << 63) <= x < 1 << 64:  # what msgpack carries: a proof parsed here packs into a report again
        raise FraudProofError("an integer out of range")
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
    if not (0 <= p.start < p.end <= p.n_layer <= MAX_LAYERS):
        raise FraudProofError(f"bad layers {p.start}:{p.end} of {p.n_layer}")
    if not (0 <= p.step < MAX_POSITION and 0 <= p.position < MAX_POSITION and 0 <= p.max_tokens < MAX_POSITION):
        raise FraudProofError("step, position or max_tokens out of range")
    if len(p.tokens) > MAX_PROOF_TOKENS or any(type(t) is not int or not 0 <= t < 1 << 32 for t in p.tokens):
        raise FraudProofError(f"a proof carries at most {MAX_PROOF_TOKENS} 32-bit token ids")
    if len(p.chain) >= MAX_PROOF_STEPS or (p.chain and len(p.chain) != p.step):
        raise FraudProofError(f"a proof's chain is the peer's commitments to every step before the one that "
                              f"differs (at most {MAX_PROOF_STEPS - 1})")
    for x in p.chain:  # as from_content reads them: a proof made here must parse where it is sent
        if not (type(x.route_epoch) is int and type(x.position) is int and 0 <= x.route_epoch < MAX_POSITION
                and 0 <= x.position < MAX_POSITION):
            raise FraudProofError("a chain link's epoch or position is out of range")
        if type(x.decode) is not bool or any(type(d) is not bytes or len(d) != DIGEST_BYTES
                                             for d in (x.input_digest, x.output_digest)):
            raise FraudProofError(f"a chain link's decode is a boolean and its digests {DIGEST_BYTES} bytes")
    cuts = p.cuts
    if len(cuts) > MAX_CUTS or any(type(x) is not int for x in cuts) or (cuts and (
            cuts[0] != 0 or list(cuts) != sorted(set(cuts)) or cuts[-1] >= p.start)):
        raise FraudProofError("a proof's cuts are the ascending first layers of the hops before the peer's, from 0")
    c = p.commitment
    if c is not None and (c.peer_id, c.session_id, c.model_digest, c.recipe_digest, c.start, c.end, c.index,
                          c.position) != (p.peer_id, p.session_id, p.model_digest, p.recipe_digest, p.start, p.end,
                                          p.step, p.position):
        raise FraudProofError("the commitment is not the audited peer's for that session, span and step")
