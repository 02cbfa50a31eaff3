"""The client: find a route through the swarm and generate tokens through it.

    client = Client(bootstrap=["/ip4/127.0.0.1/udp/4001/p2p/12D3KooW..."])
    result = client.generate("The capital of France is", max_tokens=32)   # plain code
    result = await client.agenerate(...)                                  # from trio

Discovery: a DHT node in client mode fetches the signed capability reports
for the model; only reports that agree on the recipe form a route (a peer on
another recipe would compute other numbers). The route is the cheapest chain
of peers covering every layer (:func:`meshnet_p2p.swarm.placement.plan_route`),
found by route/search.py.

By default the route is a ring (route/ring.py, docs/ring.md): each peer forwards its
output to the next, the tail its token to the head, and every hop sends the
client a copy, so a token costs one network crossing per hop. With
``ring=False`` (a star, route/star.py) the client carries every hidden state itself,
two crossings a hop. Either way the client keeps each hop's inputs. When a peer
dies, stalls past the step deadline or answers with an error, the client bans
it for a while, plans a replacement for just that span of layers, replays the
span's inputs into the replacement (rebuilding its cache), rolls a ring's other
hops back to the step that failed, and goes on (route/failover.py). With greedy
sampling (or a seed) the output is the same as without the failure.
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import trio

from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.core.multiaddr import Multiaddr
from meshnet_p2p.core.stats import ClientStats
from meshnet_p2p.dataplane.transport.pool import ChannelPool
from meshnet_p2p.dataplane.transport.tls import make_client_credentials
from meshnet_p2p.engine.contract import SamplingParams
from meshnet_p2p.swarm.placement import Span, plan_route, replayable, span_network
from meshnet_p2p.core.records import wall_ms
from meshnet_p2p.swarm.view import routable_spans, survey
from meshnet_p2p.trust.verdicts import report_key, sign_report
from meshnet_p2p.trust.policy import TrustPolicy
from meshnet_p2p.route.chain import Chain
from meshnet_p2p.route.errors import GenerationError, RequestRefused
from meshnet_p2p.route.generation import Generation, generate
from meshnet_p2p.route.hop import DishonestHop, route_fingerprint
from meshnet_p2p.route.options import PeerMeasures, RouteOptions
from meshnet_p2p.route.ring import RingRoute
from meshnet_p2p.route.star import StarRoute
from meshnet_p2p.verify.auditor import Auditor, transcripts
from meshnet_p2p.verify.crosscheck import CrossCheckedRoute, OutputWithheld, networks_of, peers_of
from meshnet_p2p.verify.peer_records import AUDIT_RATE, PeerRecords, records_path
from meshnet_p2p.verify.reports import exchange_reports, fetch_reports

from . import bridge
from .text import TextStream, prompt_ids

REPORT_LOOKUP_TIMEOUT_S = 5.0  # the most a survey waits for the fraud reports against its trusted peers
SPANS_MAX_AGE_S = 5.0  # a generation may start from a survey this recent (a failover always surveys afresh)
VERIFY_MODES = ("auto", "always", "off")


def _checked_mode(verify: str) -> str:
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {', '.join(VERIFY_MODES)}, not {verify!r}")
    return verify


def open_route(spans_provider: Callable[[], list[Span]], n_layer: int, opts: RouteOptions,
               measures: PeerMeasures | None = None) -> Chain:
    """A route over every layer, opened: a ring or a star as ``opts.ring`` says."""
    return (RingRoute if opts.ring else StarRoute).open(spans_provider, n_layer, opts, measures)


@dataclass
class GenerationResult(Generation):
    """A generation through the swarm: the local one's figures, plus its text and route."""

    text: str = ""
    route: list[dict] = field(default_factory=list)
    failovers: int = 0
    verification: dict = field(default_factory=dict)  # whether and how the output was checked


class Client:
    """Generates through the swarm, on recipes this client holds certified only.

    ``trust``: whose certificates count (default: the bootstrap peers' keys, and
    ``identity``'s if given, see :class:`TrustPolicy`)."""

    def __init__(self, bootstrap: Sequence[str | Multiaddr], *, model_path: str | None = None,
                 model_digest: str | None = None, step_timeout: float = 10.0, max_failovers: int = 4,
                 on_event: Callable[[str], None] | None = None, trust: TrustPolicy | None = None,
                 identity: Identity | None = None, ring: bool = True, verify: str = "auto",
                 audit_rate: float = AUDIT_RATE, keep_records: bool = False, model_ref: str | None = None) -> None:
        from meshnet_p2p.engine.cut import inspect_gguf
        from meshnet_p2p.engine.tokenizer import Tokenizer
        from meshnet_p2p.engine.models import default_model_path

        self.bootstrap = list(bootstrap)
        self.trust = trust if trust is not None else TrustPolicy.default(self.bootstrap, own=identity)
        if model_ref is not None:  # no file here: a name (or digest) the trusted catalogues give, its header fetched
            from .named import open_named

            named = open_named(self.bootstrap, model_ref, self.trust, log=lambda m: on_event and on_event(m))
            path, self.n_layer, self.model_digest, self.model_name = (named.path, named.n_layer, named.model_digest,
                                                                      named.name)
        else:
            path = model_path or default_model_path()
            info = inspect_gguf(path)  # hashes an uncut model; a shard carries its source's digest
            self.n_layer = info.source_layers
            self.model_digest = model_digest or info.model_digest
            # the file name up to its first dot: "SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct"
            self.model_name = os.path.basename(path).split(".")[0] or self.model_digest
        self.tokenizer = Tokenizer(path)  # vocabulary only: the client loads no weights
        self.step_timeout = step_timeout
        self.max_failovers = max_failovers
        self.on_event = on_event
        self.ring = ring  # peers forward hidden states to each other (docs/ring.md)
        self.pool = ChannelPool()  # one connection per peer for all of this client's generations
        self.measures = PeerMeasures()  # round trips and decode costs, kept across generations
        # peers count this client's sessions under its identity (the process's own when none is given)
        self.client_creds = make_client_credentials(identity) if identity is not None else None
        self._survey_lock = threading.Lock()  # the last survey, shared by generations that start together
        self._survey: tuple[float, list[Span]] | None = None
        self._surveying: threading.Event | None = None
        self.stats = ClientStats()  # generations, tokens, failovers: read by the api role's metrics
        if not 0.0 <= audit_rate <= 1.0:
            raise ValueError(f"audit_rate must be between 0 and 1, not {audit_rate!r}")
        # "auto": a route that depends on a peer with no verified record is cross-checked by a second
        # route; "always": every generation is; "off": none (docs/verification.md)
        self.verify = _checked_mode(verify)
        self.audit_rate = audit_rate
        # what this client verified of each peer, and whom it caught; with keep_records, in this machine's
        # file for the model (records.records_path), shared by its runs and shown by status
        self.records = PeerRecords(records_path(self.model_digest) if keep_records else None)
        # audits run in a thread of their own, after each generation: its surveys run trio loops of their own
        # proofs found here are published signed by this client's identity (a fresh one when none is given)
        self.reporter = identity or Identity.generate()
        self.auditor = Auditor(self.records, self._provider(trio.run), self._audit_options, self.measures, audit_rate,
                               on_event=lambda m: self.on_event and self.on_event(m),
                               sign_report=self.sign_report, exchange=lambda pub, look: self.exchange_reports(pub, look)[0])

    def close(self) -> None:
        """Close the connections this client keeps to peers (generations under way fail, audits not started
        are dropped, one under way stops at its next look at the swarm)."""
        self.auditor.close()
        self.pool.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait_audits(self, timeout: float | None = None) -> bool:
        """Wait for the audits of past generations (False if ``timeout`` passed first)."""
        return self.auditor.wait(timeout)

    def sign_report(self, proof) -> tuple[str, bytes]:
        """A fraud report of a transferable ``proof``, signed by this client: (DHT key, record wire)."""
        return report_key(proof.model_digest, proof.peer_id), sign_report(self.reporter, proof, now_ms=wall_ms())

    def exchange_reports(self, publish: list[tuple[str, bytes]], lookup: list[str]) -> tuple[dict, int]:
        """Publish reports, fetch those against ``lookup``'s peers (from plain code: a trio loop of its
        own): (peer -> its reports, how many DHT nodes took the published ones)."""
        found, stored = trio.run(functools.partial(exchange_reports, self.bootstrap, self.model_digest, publish, lookup))
        if publish and self.on_event:
            self.on_event(f"published {len(publish)} fraud report(s); {stored} taken by DHT nodes")
        return found, stored

    def _plan(self, spans, start: int, end: int, **kw) -> list[Span]:
        """The cheapest route, peers with a verified record preferred (placement.py's unverified charge)."""
        return plan_route(spans, start, end, prefer={s.peer_id for s in spans if self.records.verified(s.peer_id)},
                          **kw)

    def _audit_options(self) -> RouteOptions:
        return self.route_options(1, SamplingParams(), False)  # audit_hop sets the replay's own session

    async def spans(self, *, max_age_s: float = 0.0) -> list[Span]:
        """The spans of the certified recipe a route is planned over (RecipeNotCertified if none).
        With ``max_age_s``, a survey that recent (or one under way) is shared: sixteen users
        starting at once make one survey, not sixteen bursts at the bootstrap peers."""
        while max_age_s > 0:
            with self._survey_lock:
                if self._survey is not None and time.monotonic() - self._survey[0] <= max_age_s:
                    return self._survey[1]
                under_way = self._surveying
                if under_way is None:
                    break
            await bridge.wait_event(under_way)  # then look again (it may have failed: survey then)
        mine = threading.Event()
        with self._survey_lock:
            self._surveying = self._surveying or mine
        try:
            found: dict = {}

            async def reports(node, view) -> None:
                # before a route is planned: the reports against the peers this client would let
                # decide an answer alone (the others are cross-checked and audited anyway)
                vouched = self._vouched(view)
                trusted = [s.peer_id for s in routable_spans(view, self.trust)
                           if s.peer_id in vouched or self.records.verified(s.peer_id)]
                due = self.auditor.due(trusted)
                if not due:
                    return
                # bounded: a slow DHT delays the first token by this much at most, and a lookup
                # that fails is the survey's loss of nothing but the reports (looked up again after)
                with trio.move_on_after(REPORT_LOOKUP_TIMEOUT_S):
                    try:
                        found.update(await fetch_reports(node, self.model_digest, due))
                        return
                    except MeshnetError as e:
                        if self.on_event:
                            self.on_event(f"could not look up fraud reports: {e}")
                self.auditor.forget(due)  # not looked up after all: due again at the next look

            view = await survey(self.bootstrap, self.model_digest, self.n_layer, self.trust,
                                then=reports if self.verify != "off" else None)
            spans = routable_spans(view, self.trust)
            # the peers whose work a trusted certificate's evidence shows exact, or a trusted certifier's
            # own audits verified, have a verified record; those it convicted are left out
            self.records.vouch(self._vouched(view))
            self.records.convict(view.convicted())
            self.auditor.heard(found)  # a reported peer has no verified record until settled here
            with self._survey_lock:
                self._survey = (time.monotonic(), spans)
            return spans
        finally:
            with self._survey_lock:
                if self._surveying is mine:
                    self._surveying = None
            mine.set()

    @staticmethod
    def _vouched(view) -> set[str]:
        return {p for r in view.certified() for p, _, _ in r.certificate.route} | view.verified_by_certifiers()

    def _provider(self, run: bridge.AsyncRunner) -> Callable[[], list[Span]]:
        """A route's spans: a recent survey at first, a fresh one each time it looks
        again (after failures, the swarm may have changed)."""
        looks = itertools.count()

        def provide() -> list[Span]:
            spans = run(functools.partial(self.spans, max_age_s=0.0 if next(looks) else SPANS_MAX_AGE_S))
            caught = self.records.caught()  # a peer proven to compute something else is never planned again
            return [s for s in spans if s.peer_id not in caught] if caught else spans
        return provide

    def generate(self, prompt: str, max_tokens: int = 64, sampling: SamplingParams | None = None, *,
                 chat: bool = False, on_token: Callable[[str], None] | None = None, stop_at_eog: bool = True,
                 verify: str | None = None) -> GenerationResult:
        """From plain (non-trio) code. ``verify``: this generation's mode (default: the client's)."""
        return bridge.from_plain_code(functools.partial(
            self._generate, prompt=prompt, max_tokens=max_tokens, sampling=sampling or SamplingParams(),
            chat=chat, on_token=on_token, stop_at_eog=stop_at_eog, verify=self._mode(verify)))

    async def agenerate(self, prompt: str, max_tokens: int = 64, sampling: SamplingParams | None = None, *,
                        chat: bool = False, on_token: Callable[[str], None] | None = None,
                        stop_at_eog: bool = True, verify: str | None = None) -> GenerationResult:
        """From trio: the token loop runs in one worker thread (blocking gRPC), and
        route discovery comes back to this trio loop."""
        return await bridge.from_trio(functools.partial(
            self._generate, prompt=prompt, max_tokens=max_tokens, sampling=sampling or SamplingParams(),
            chat=chat, on_token=on_token, stop_at_eog=stop_at_eog, verify=self._mode(verify)))

    def _mode(self, verify: str | None) -> str:
        return self.verify if verify is None else _checked_mode(verify)

    def _generate(self, run: bridge.AsyncRunner, **request) -> GenerationResult:
        try:
            result = self._run(self._provider(run), **request)
        except Exception:
            self.stats.generations.add("failed")
            raise
        s = self.stats
        s.generations.add("completed")
        s.tokens.add("prompt", result.prompt_tokens)
        s.tokens.add("generated", len(result.token_ids))
        s.first_token_seconds.observe(result.ttft_ms / 1000)
        return result

    def route_options(self, max_tokens: int, sampling: SamplingParams, stop_at_eog: bool) -> RouteOptions:
        """What this client opens a route with, for ``max_tokens`` positions in all."""
        return RouteOptions(max_tokens=max_tokens, sampling=sampling, ring=self.ring, stop_at_eog=stop_at_eog,
                            planner=self._plan,
                            step_timeout=self.step_timeout, max_failovers=self.max_failovers,
                            client_creds=self.client_creds, pool=self.pool,
                            on_event=self.on_event or (lambda msg: None))

    def _run(self, provider, *, prompt, max_tokens, sampling, chat, on_token, stop_at_eog, verify) -> GenerationResult:
        ids = prompt_ids(self.tokenizer, prompt, chat)
        if not ids:
            raise GenerationError("the prompt is empty")
        opts = self.route_options(len(ids) + max_tokens, sampling, stop_at_eog)
        try:
            route = self._open_checked(provider, opts, verify)
        except RequestRefused as e:  # say what was asked, beside what the peers said they hold
            raise RequestRefused(f"the prompt has {len(ids)} tokens and max_tokens asks for {max_tokens} more "
                                 f"({len(ids) + max_tokens} positions in all): {e}") from None
        text = TextStream(self.tokenizer, on_token)
        try:
            run = generate(route, ids, max_tokens, stop_at_eog=stop_at_eog, on_token=text.on_token)
            text.finish()
            # the routes the answer came from, and every route that computed for it (dropped ones too)
            live, used = (route.routes, route.all_routes()) if isinstance(route, CrossCheckedRoute) \
                else ([route], [route])
            signed = self._check_signatures(live)
            # a whole-model hop a route of verified peers matched step for step was checked as an
            # audit would check it: counted as this client's own, and not replayed again
            checked = route.checked_alone() if isinstance(route, CrossCheckedRoute) else set()
            for peer in checked:
                self.records.matched(peer)
            # nor is a hop no peer on another network could replay (as the last survey found the
            # swarm): its audit would look for a replayer and find none, at every session
            audits = self.auditor.pick(used, self.n_layer, skip=checked | set(self._unauditable(used)))
            # after the answer, off its latency; then reports published and fetched for the peers used
            self.auditor.submit(audits, peers=[p for r in used for p in peers_of(r)])
            verification = {**self._verification(route), "signed_steps": signed,
                            "audits": [{"peer_id": t.peer_id, "layers": [t.start, t.end]} for t in audits]}
            return GenerationResult(prompt_tokens=len(ids), token_ids=run.token_ids, ttft_ms=run.ttft_ms,
                                    decode_ms=run.decode_ms, stopped=run.stopped, steps=run.steps,
                                    text=self.tokenizer.decode(run.token_ids),
                                    route=route.route(), failovers=route.failovers,
                                    verification=verification)
        finally:
            self.stats.failovers.add("failovers", route.failovers)  # a failed generation's too
            route.close()

    def _check_signatures(self, routes: list[Chain]) -> int:
        """Every hop's per-step commitments verified, after the generation (off the token's
        path): a hop whose signatures do not verify made its work unprovable, so the answer
        it took part in is withheld and the peer is caught. Returns how many steps were signed."""
        try:
            return sum(r.verify_commitments() for r in routes)
        except DishonestHop as e:
            self.records.catch(e.peer_id, f"sent step commitments that do not verify: {e}")
            raise OutputWithheld(f"{e}; the answer is withheld") from None

    def _open_checked(self, provider, opts: RouteOptions, verify: str):
        """The route a generation runs on: one route ("off"); two disjoint ones cross-checked step by
        step ("always"); or one that enlists a second as soon as it depends on a peer with no verified
        record, or on one peer alone this client has not checked itself ("auto": at its first step,
        or after a failover brings one in)."""
        primary = open_route(provider, self.n_layer, opts, self.measures)
        if verify == "off":
            return primary

        def open_disjoint(exclude: set[str], networks: set[str] = frozenset(), *, verified_only: bool = False) -> Chain:
            def spans() -> list[Span]:
                return [s for s in provider() if s.peer_id not in exclude and span_network(s) not in networks
                        and (not verified_only or self.records.verified(s.peer_id))]
            return open_route(spans, self.n_layer, opts, self.measures)
        routes = [primary]
        if verify == "always":
            try:
                routes.append(open_disjoint(peers_of(primary) | set(self.records.caught()), networks_of(primary)))
            except GenerationError as e:
                primary.close()
                raise OutputWithheld(f"verification needs two routes with no peer and no network in common, and "
                                     f"there is no second one: {e}") from None
            except BaseException:
                primary.close()
                raise
        return CrossCheckedRoute(routes, open_disjoint, self.records, on_event=opts.on_event,
                                 localize=lambda bad: self.auditor.localize(bad, self.n_layer, provider),
                                 prove=lambda bad: self.auditor.submit(transcripts(bad, self.n_layer)))

    def _verification(self, route) -> dict:
        if isinstance(route, CrossCheckedRoute):
            out, routes = route.summary(), route.routes
        else:
            out, routes = {"mode": "off", "unverified_peers": sorted(
                p for p in peers_of(route) if not self.records.verified(p))}, [route]
        return {**out, "unauditable_peers": self._unauditable(routes)}

    def _unauditable(self, routes: list[Chain]) -> list[str]:
        """The peers of ``routes`` whose span no peer on another network could replay (as the last
        survey found the swarm): no audit checks them, and each alone decides what its layers give."""
        with self._survey_lock:
            spans = self._survey[1] if self._survey is not None else []
        out = set()
        for r in routes:
            for h in r.hops:
                seam = route_fingerprint(h.span.record.content).recipe_axes.get("seam_dtype") \
                    if h.span.record is not None else None
                if not replayable(h.span, spans, composes=seam == "f32"):
                    out.add(h.span.peer_id)
        return sorted(out)
