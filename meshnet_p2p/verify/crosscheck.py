"""Cross-checked generation: two routes with no peer in common, stepped side by
side, and a token handed on only when both computed it.

Used when a route depends on a peer with no verified record (peer_records.py), or
on one peer alone that this client has not checked itself (a route of one hop: one
identity computes the whole answer, and a certifier's vouch is someone else's check;
issue 59, the sleeper), or always with ``verify="always"``. Started with one route (``verify="auto"``),
it steps that route alone while every peer on it has a record, and enlists a
disjoint second route, brought level by replaying the steps so far, as soon
as one has none: at the first step, or after a failover that brought in a
peer without one. With no disjoint route to enlist, the generation goes on
unchecked (said in an event and in ``summary()``); the audits after it still
replay the hops. Honest peers of one certified recipe compute
bit-identical outputs, so two honest routes give the same token at every step;
a disagreement means at least one peer computed something else. It is settled
by a third route, disjoint from both, brought to the same step by replaying the
generation's steps (the same prompt chunks and tokens, so the same micro-batch
structure): the route the third agrees with goes on, the other is dropped. A
dropped route of one hop was given exactly the inputs the two others were, so
its peer is proven wrong by two independent replays (caught, left out of every
plan); a dropped route of several hops is handed to ``localize`` (an audit of
each hop by replay) to find which one. When no third route exists, or it agrees
with neither, the answer is withheld (:class:`OutputWithheld`), never guessed.
"""

from __future__ import annotations

from concurrent import futures
from typing import Callable, Sequence

from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.swarm.placement import span_network

from meshnet_p2p.route.chain import Chain
from meshnet_p2p.route.errors import GenerationError

from .peer_records import PeerRecords


class OutputWithheld(GenerationError):
    """The routes disagreed and nothing could decide which one is right."""


def same_output(a, b) -> bool:
    return (a.token_id, bool(a.is_eog)) == (b.token_id, bool(b.is_eog))


def peers_of(route: Chain) -> set[str]:
    """Every peer that computed anything for ``route`` (failed-over ones too)."""
    return {h.span.peer_id for h in [*route.hops, *route.retired]}


def networks_of(route: Chain) -> set[str]:
    """The networks of every peer that computed anything for ``route`` (placement.span_network)."""
    return {span_network(h.span) for h in [*route.hops, *route.retired]}


def _describe(reply) -> str:
    return "end of generation" if reply.is_eog else f"token {reply.token_id}"


class CrossCheckedRoute:
    """A Route (route/generation.py) over two disjoint routes; ``open_disjoint(exclude, networks,
    verified_only=False)`` opens another route over every layer, with none of the peers in
    ``exclude`` nor any peer of the networks in ``networks`` (many identities of one network
    are one witness), and only peers with a verified record when ``verified_only`` (the third
    route that settles a dispute: a stranger's word cannot decide one).
    opens another route over every layer, with none of the peers in ``exclude``."""

    def __init__(self, routes: Sequence[Chain], open_disjoint: Callable[..., Chain], records: PeerRecords,
                 *, localize: Callable[[Chain], list[str]] | None = None,
                 prove: Callable[[Chain], None] | None = None, on_event: Callable[[str], None] = lambda msg: None) -> None:
        if len(routes) not in (1, 2):
            raise ValueError("a cross-checked route steps one route, or two")
        self.routes = list(routes)
        self.unchecked = ""  # why no second route could be enlisted, when none could
        self.open_disjoint = open_disjoint
        self.records = records
        self.localize = localize
        self.prove = prove  # a one-hop route caught here is audited later too: that makes a proof others can check
        self.on_event = on_event
        self.steps: list[tuple[int, tuple[int, ...], bool]] = []  # every step so far, to bring a new route level
        self.compared = 0  # steps whose reply two routes agreed on (or a third settled)
        self.disputes: list[dict] = []
        self.dropped: list[Chain] = []  # routes dropped (their hops' transcripts are still audited)
        self._pool = futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="cross-check")

    @property
    def n_ubatch(self) -> int:
        return self.routes[0].n_ubatch  # one certified recipe: one micro-batch size

    @property
    def failovers(self) -> int:
        return sum(r.failovers for r in [*self.routes, *self.dropped])

    def route(self) -> list[dict]:
        return self.routes[0].route()

    def all_routes(self) -> list[Chain]:
        return [*self.routes, *self.dropped]

    def _excluded(self) -> set[str]:
        return set().union(*(peers_of(r) for r in self.all_routes())) | set(self.records.caught())

    def _networks(self) -> set[str]:
        return set().union(*(networks_of(r) for r in self.all_routes()))

    def step(self, position: int, token_ids: Sequence[int], decode: bool):
        token_ids = tuple(token_ids)
        self.steps.append((position, token_ids, decode))
        if len(self.routes) == 1:
            self._enlist()  # before the step, so that both compute it side by side
        if len(self.routes) == 1:
            reply = self.routes[0].step(position, token_ids, decode)
            if not self._enlist():  # a failover in that step may have brought in a peer with no record
                return reply
            replies = [reply, self.routes[1].step(position, token_ids, decode)]
        else:
            replies = self._step_both(position, token_ids, decode)
        self.compared += 1
        if same_output(*replies):
            return replies[0]
        return self._settle(position, replies)

    def needs_check(self, route: Chain) -> bool:
        """Whether ``route`` alone may not decide an answer: a peer on it has no verified record,
        or one peer computes every layer and this client has not checked it itself."""
        peers = peers_of(route)
        if not all(self.records.verified(p) for p in peers):
            return True
        return len(route.hops) == 1 and not self.records.checked(route.hops[0].span.peer_id)

    def checked_alone(self) -> set[str]:
        """The peers that computed a whole answer alone (a route of one hop, no failover) and whose
        every step a route of verified peers on other networks gave exactly too: this client has
        checked their session as an audit would (a whole-model hop's outputs are the tokens an
        audit compares), so it need not be replayed again."""
        if self.compared != len(self.steps) or len(self.routes) != 2 or self.dropped:
            return set()  # a route brought level later was compared from then on only
        out = set()
        for i, r in enumerate(self.routes):
            other = self.routes[1 - i]
            peers = peers_of(r)
            if len(peers) == 1 and len(r.hops) == 1 and all(self.records.verified(p) for p in peers_of(other)) \
                    and not peers & peers_of(other) and not networks_of(r) & networks_of(other):
                out |= peers
        return out

    def _enlist(self) -> bool:
        """With one route that may not decide alone (:meth:`needs_check`), open a disjoint second one,
        level with the steps before the current one's (``self.steps[:-1]``); True if it did."""
        route = self.routes[0]
        if self.unchecked or not self.needs_check(route):
            return False
        try:
            shadow = self.open_disjoint(self._excluded(), self._networks())
        except MeshnetError as e:
            self.unchecked = str(e)
            unverified = sorted(p[-8:] for p in peers_of(route) if not self.records.verified(p))
            if unverified:
                self.on_event(f"no second route to check peers with no verified record ({', '.join(unverified)}): "
                              f"the output is not cross-checked ({e})")
            else:
                self.on_event(f"peer {route.hops[0].span.peer_id[-8:]} computes every layer alone and this client "
                              f"has not checked it itself; no second route to check it: the output is not "
                              f"cross-checked ({e})")
            return False
        try:
            for position, token_ids, decode in self.steps[:-1]:
                shadow.step(position, token_ids, decode)
        except BaseException:
            shadow.close()
            raise
        self.routes.append(shadow)
        return True

    def _step_both(self, position: int, token_ids: tuple[int, ...], decode: bool) -> list:
        """Both routes' replies to one step, side by side; a route that gives up
        (its failovers spent) is replaced by a new disjoint one brought level."""
        pending = [self._pool.submit(r.step, position, token_ids, decode) for r in self.routes]
        replies = []
        for i, f in enumerate(pending):
            try:
                replies.append(f.result())
            except GenerationError as e:
                replies.append(self._replace(i, e))
        return replies

    def _replace(self, index: int, error: Exception):
        """The route at ``index`` failed for good: a new one, disjoint from every route so far, brought
        to the current step; its reply to that step. Without one the output would rest on one route."""
        old = self.routes[index]
        self.on_event(f"a cross-checking route failed ({error}); opening another")
        old.close()
        self.dropped.append(old)
        try:
            new = self.open_disjoint(self._excluded(), self._networks())
        except MeshnetError as e:
            raise OutputWithheld(f"a cross-checking route failed ({error}) and no other route with no peer in "
                                 f"common could replace it ({e}); the answer is withheld") from None
        self.routes[index] = new
        return self._bring_level(new)

    def _bring_level(self, route: Chain):
        """Replay every step so far through ``route``; its reply to the last."""
        reply = None
        for position, token_ids, decode in self.steps:
            reply = route.step(position, token_ids, decode)
        return reply

    def _settle(self, position: int, replies: list):
        a, b = self.routes
        what = f"at position {position} the routes disagree ({_describe(replies[0])} and {_describe(replies[1])})"
        self.on_event(f"{what}; asking a third route")
        try:
            third = self.open_disjoint(self._excluded(), self._networks(), verified_only=True)
        except MeshnetError as e:
            self._audit_both()
            raise OutputWithheld(f"{what}, and no third route of verified peers on other networks could decide "
                                 f"({e}); the answer is withheld") from None
        try:
            decider = self._bring_level(third)
        except BaseException:
            third.close()
            raise
        agree = [i for i, r in enumerate(replies) if same_output(r, decider)]
        if len(agree) != 1:
            third.close()
            self._audit_both()
            raise OutputWithheld(f"{what}, and a third route gave {_describe(decider)}: nothing decides; "
                                 "the answer is withheld")
        good, bad = self.routes[agree[0]], self.routes[1 - agree[0]]
        caught = self._convict(bad, position, replies[1 - agree[0]], decider)
        self.disputes.append({"position": position, "kept": good.route(), "dropped": bad.route(),
                              "decided_by": third.route(), "caught": caught})
        bad.close()
        self.dropped.append(bad)
        self.routes = [good, third]
        return replies[agree[0]]

    def _audit_both(self) -> None:
        """A disagreement nothing here could decide: every hop of both routes goes to the audits
        (``prove``), whose replays on other networks can still prove which one lied, and publish
        it, so that the next client is not left to withhold again."""
        if self.prove is not None:
            for r in self.routes:
                self.prove(r)

    def _convict(self, bad: Chain, position: int, wrong, right) -> list[str]:
        """Who on ``bad`` computed something else: proven for a route of one hop (it
        took exactly the inputs the two routes that agree took), by ``localize`` else."""
        hops = [*bad.hops, *bad.retired]
        if len(hops) == 1:
            peer = hops[0].span.peer_id
            why = (f"gave {_describe(wrong)} at position {position} where two independent routes replaying "
                   f"its inputs gave {_describe(right)}")
            self.records.catch(peer, why)
            self.on_event(f"peer {peer} caught: it {why}; it is left out from now on")
            if self.prove is not None:
                self.prove(bad)
            return [peer]
        caught = self.localize(bad) if self.localize is not None else []
        if not caught:
            for h in hops:  # no proof against any one of them: none is blamed, every one is checked again
                self.records.unconfirmed(h.span.peer_id)
            self.on_event(f"route {[h.span.peer_id[-8:] for h in hops]} was outvoted; no single peer proven")
        return caught

    def summary(self) -> dict:
        checked = len(self.routes) == 2 or bool(self.disputes)
        mode = "cross-checked" if checked else "unchecked" if self.unchecked else "verified-peers"
        unverified = sorted(p for r in self.routes for p in peers_of(r) if not self.records.verified(p))
        return {"mode": mode, "routes": [r.route() for r in self.routes], "disputes": self.disputes,
                "unverified_peers": unverified}

    def close(self) -> None:
        try:
            for r in self.routes:
                r.close()
        finally:
            self._pool.shutdown(wait=True)
