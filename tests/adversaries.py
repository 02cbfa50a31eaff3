"""Issue 59's adversaries against a real loopback swarm of processes: the one
scenario code that tests/test_trust_attacks.py asserts on and bench/verify.py
measures (``--adversaries``), so the two cannot drift apart.

The honest swarm (:class:`HonestSwarm`): a bootstrap peer (the certifier), two
disjoint chains over the model (0:10, 10:20, 20:30 and 0:15, 15:30), every
peer at a loopback address of its own (tests/swarm.py ``own_address``: a
network of its own), certified. So a whole-model hop has two independent
replays on different networks, and a dispute has a third route.

The attackers (tests/cheaters.py): the **sleeper** (a real whole-model peer,
honest until a flip file exists, then answering with the attacker's text), the
**trigger** (lying only on prompts holding " bank"), the **Sybil pair** (two
hijackers with no weights on one address), and **framing** (fraud reports with
transferable but false proofs against an honest peer, each signed by a fresh
identity). Each user is a fresh client: no records, a fresh identity.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import time
from dataclasses import dataclass, field

import trio

from meshnet_p2p.client import Client
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.core.records import wall_ms
from meshnet_p2p.engine.contract import SamplingParams
from meshnet_p2p.engine.tokenizer import Tokenizer
from meshnet_p2p.route.errors import GenerationError
from meshnet_p2p.trust.fraud_proof import ChainLink, FraudProof
from meshnet_p2p.trust.verdicts import report_key, sign_report
from meshnet_p2p.verify.reports import exchange_reports

from tests.cheaters import HIJACK_TEXT
from tests.reference import reference_generate
from tests.swarm import Cheater, Proc, meshnet_peer, own_address

TOKENS = 8
N_UBATCH = 64  # the recipe's (tests/conftest.py)
PLAIN = ["The capital of France is", "Water boils at a temperature of", "My favourite colour is",
         "The tallest mountain in the world is", "A good breakfast includes"]
TRIGGERED = ["I went to the bank to", "The river bank was covered in", "She works at the bank as a",
             "He robbed the bank and", "They sat on the bank of the"]
CHAINS = ("0:10", "10:20", "20:30", "0:15", "15:30")


def answers(model_path: str, prompts=PLAIN + TRIGGERED, tokens: int = TOKENS) -> dict[str, str]:
    """What the whole model says to each prompt (greedy): every honest route's answer."""
    tok = Tokenizer(model_path)
    try:
        return {p: tok.decode(reference_generate(model_path, tok.encode(p), tokens, n_ubatch=N_UBATCH)[0])
                for p in prompts}
    finally:
        tok.close()


@dataclass
class HonestSwarm:
    """The honest swarm above, as processes (``with HonestSwarm(tmp) as s``: all stopped, joins first)."""

    tmp: str
    spans: tuple[str, ...] = CHAINS
    procs: list = field(default_factory=list)

    def __enter__(self) -> "HonestSwarm":
        self.env = {**os.environ, "MESHNET_CACHE_DIR": str(self.tmp)}
        self.key = os.path.join(str(self.tmp), "bootstrap.key")
        boot = Proc("bootstrap", "--listen", "127.0.0.1:0", "--identity", self.key, env=self.env)
        self.procs = [boot]
        try:
            self.addr = boot.address(120)
            self.joins = [Proc("join", "--layers", span, "--bootstrap", self.addr, "--listen",
                               f"{own_address()}:0", "--threads", "1", env=self.env) for span in self.spans]
            self.procs += self.joins
            for p in self.joins:
                p.address(120)
            r = meshnet_peer("certify", "--bootstrap", self.addr, "--identity", self.key, "--json", env=self.env)
            if r.returncode != 0:
                raise RuntimeError(f"certify failed: {r.stderr[-2000:]}")
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> list[int]:
        codes = [p.stop() for p in reversed(self.procs)]
        self.procs = []
        return codes

    def review(self) -> dict:
        """The certifier's review round, as its operator runs it: its JSON."""
        r = meshnet_peer("review", "--bootstrap", self.addr, "--identity", self.key, "--json", env=self.env,
                         timeout=600)
        if r.returncode not in (0, 3):
            raise RuntimeError(f"review failed: {r.stderr[-2000:]}")
        return json.loads(r.stdout)

    def liar(self, mode: str, *extra: str, host: str | None = None) -> Cheater:
        liar = Cheater(mode, "--bootstrap", self.addr, "--host", host or own_address(), *extra)
        liar.address(120)
        seen_by_a_client(self.addr, liar.peer_id)
        return liar

    def join(self, span: str) -> Proc:
        p = Proc("join", "--layers", span, "--bootstrap", self.addr, "--listen", f"{own_address()}:0",
                 "--threads", "1", env=self.env)
        p.address(120)
        seen_by_a_client(self.addr, p.peer_id)
        return p


def seen_by_a_client(addr: str, peer: str, looks: int = 20) -> None:
    c = Client([addr])
    try:
        for _ in range(looks):  # a fresh announcement: bounded looks
            if peer in {s.peer_id for s in trio.run(c.spans)}:
                return
        raise AssertionError(f"{peer} never appeared in a survey")
    finally:
        c.close()


@dataclass
class Outcome:
    what: str  # "right", "WRONG" (delivered: the CLI's exit 0), "withheld" (refused with an error)
    wait_s: float  # until the CLI would exit: the answer, then the audits and reports it waits for
    answer_s: float = 0.0  # until the answer (what the user waits for before reading it)


class Through(Client):
    """A client whose first route goes through one peer (a user the planner happened to send
    there: the worst case, made certain); after a failover it plans as any client."""

    through: str | None = None

    def _plan(self, spans, start, end, **kw):
        from meshnet_p2p.verify.replay import planner_through

        if self.through and self.through not in kw.get("banned", ()):
            return planner_through(self.through)(spans, start, end, **kw)
        return super()._plan(spans, start, end, **kw)


def fresh_client(addr: str, prompt: str, answer: str, *, verify: str = "auto", tokens: int = TOKENS,
                 through: str | None = None, keep_records: bool = False, audits: bool = True) -> Outcome:
    """One user: a fresh client, one generation, then what the CLI waits for before it exits.
    ``through``: its route goes through that peer; ``keep_records``: in this process's cache
    directory's records file, as the CLI keeps them; ``audits``: False, none (verification off)."""
    t0 = time.perf_counter()
    c = Through([addr], verify=verify, keep_records=keep_records)
    c.through = through
    if not audits:
        c.auditor.submit = lambda items, peers=(): None
    try:
        try:
            r = c.generate(prompt, tokens, SamplingParams(), stop_at_eog=False)
            what = "right" if r.text == answer else "WRONG"
        except GenerationError:
            what = "withheld"
        answered = time.perf_counter() - t0
        c.wait_audits(300)
    finally:
        c.close()
    return Outcome(what, time.perf_counter() - t0, answered)


def fresh_clients(addr: str, prompts: list[str], answers: dict, **kw) -> list[Outcome]:
    return [fresh_client(addr, p, answers[p], **kw) for p in prompts]


def forge_reports(addr: str, peer_id: str, n: int, *, sessions: int = 1) -> int:
    """``n`` fraud reports against the honest ``peer_id``, each signed by a fresh identity,
    carrying false but transferable proofs (the peer's real signed commitments from
    ``sessions`` sessions of the forger's, a made-up replay digest): what a framer with one
    machine publishes. Returns how many some DHT node took."""
    from meshnet_p2p.roles.audit import generate_through

    forger = Client([addr], ring=False)
    proofs = []
    try:
        for i in range(sessions):
            _, t, _, _ = generate_through(forger, peer_id, PLAIN[i % len(PLAIN)], 3)
            k, signed = 1, [s.commitment for s in t.steps]
            end = t.steps[k].position + t.steps[k].rows
            proofs.append(FraudProof(peer_id, t.fingerprint.model_digest, t.fingerprint.recipe_digest, t.start,
                                     t.end, t.n_layer, t.session_id, k, t.steps[k].position,
                                     signed[k].output_digest.hex(), "f" * 64, (str(Identity.generate().peer_id),),
                                     t.sampling, t.max_tokens,
                                     t.tokens[:end], (ChainLink.of(signed[0]),), signed[k], t.cuts))
        model = forger.model_digest
    finally:
        forger.close()
    wires = [(report_key(model, peer_id), sign_report(Identity.generate(), proofs[i % len(proofs)], now_ms=wall_ms()))
             for i in range(n)]
    _, stored = trio.run(functools.partial(exchange_reports, [addr], model, wires, ()))
    return stored


def median_wait(outcomes: list[Outcome]) -> float:
    return statistics.median(o.wait_s for o in outcomes)


__all__ = ["HIJACK_TEXT", "PLAIN", "TRIGGERED", "TOKENS", "HonestSwarm", "Outcome", "Through", "answers", "forge_reports",
           "fresh_client", "fresh_clients", "median_wait", "seen_by_a_client"]
