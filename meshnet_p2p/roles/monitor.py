"""``meshnet-peer monitor``: a live web page of what the swarm serves.

One long-lived client-mode DHT node re-surveys the swarm every ``--interval``
seconds (:func:`status.survey_node`, departing peers kept); each survey becomes
a JSON doc (:func:`monitor_doc`, pure) and is compared with the last one
(:func:`diff_events`, pure) to log what changed: peers that appear, announce
their departure or vanish, reachability, certification, coverage and relays.
FastAPI on hypercorn's trio worker serves the page (``GET /``, inline CSS and
JS, nothing fetched from elsewhere) and the same data (``GET /api/swarm``).

It sees only what the DHT holds: a client's failovers are not visible to it,
and a peer's load is that peer's own claim (docs/monitor.md).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import sys
from collections import Counter, deque
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping

from meshnet_p2p.core.errors import MeshnetError, sanitize, unwrap_errors
from .flags import add_bootstrap, add_metrics, add_trust, metrics_listen, number  # light, as this module

if TYPE_CHECKING:  # cli.py imports this module to build its parser: the rest loads when the role runs
    import trio

    from meshnet_p2p.trust.policy import TrustPolicy
    from meshnet_p2p.swarm.placement import Span
    from .status import Survey

MAX_EVENTS = 200
# What one survey may put on the page: a report costs nothing to forge, so the doc
# is bounded whatever the DHT holds (the coverage counts still count every peer).
MAX_RECIPES_SHOWN = 16  # per model: certified first, then by live peers
MAX_PEERS_SHOWN = 500  # per recipe: live first; the rest counted in peers_omitted
MAX_RELAYS_SHOWN = 64
MAX_EVENTS_OF_A_KIND = 20  # per survey: beyond, one summary event (identities churned by the thousand)
SURVEY_TIMEOUT_S = 60.0  # a survey that takes longer counts as failed; the page keeps the last one
DEFAULT_LISTEN = "127.0.0.1:8080"


# --- the doc (pure) ---------------------------------------------------------------------------


def layer_counts(spans: list[Span], n_layer: int) -> list[list[int]]:
    """Live (not departing) peers per layer as runs [start, end, count] tiling
    [0, n_layer): compact however many layers an index entry claims."""
    delta: dict[int, int] = {}
    for s in spans:
        a, b = max(0, s.start), min(n_layer, s.end)
        if s.departing or a >= b:
            continue
        delta[a] = delta.get(a, 0) + 1
        delta[b] = delta.get(b, 0) - 1
    points = sorted({0, n_layer, *delta})
    runs: list[list[int]] = []
    count = 0
    for a, b in zip(points, points[1:]):
        count += delta.get(a, 0)
        if runs and runs[-1][2] == count:
            runs[-1][1] = b
        else:
            runs.append([a, b, count])
    return runs


def monitor_doc(survey: Survey, trust: TrustPolicy, *, now_ms: int) -> dict[str, Any]:
    """``status --json``'s doc (no round trips: the monitor does not probe peers),
    each peer with its label and reported load, each recipe with its per-layer counts."""
    from .status import status_doc

    doc = status_doc(survey, trust, {})
    peers, live, departing = set(), 0, 0
    for (_, view), m in zip(survey.models, doc["models"]):
        for r, rd in zip(view.recipes, m["recipes"]):
            spans = {s.peer_id: s for s in r.spans}
            for p in rd["peers"]:
                c = spans[p["peer_id"]].record.content
                del p["rtt_ms"]
                p["short_id"] = p["peer_id"][-8:]
                p["load"] = dict(c["load"]) if "load" in c else None  # optional: older peers send none
                p["version"] = c["version"]
                peers.add(p["peer_id"])
                departing += p["departing"]
                live += not p["departing"]
            rd["layer_counts"] = layer_counts(r.spans, view.n_layer)
            rd["peers_omitted"] = max(0, len(rd["peers"]) - MAX_PEERS_SHOWN)
            rd["peers"] = sorted(rd["peers"], key=lambda p: (p["departing"], p["layers"][0], p["peer_id"]))[:MAX_PEERS_SHOWN]
        m["recipes_omitted"] = max(0, len(m["recipes"]) - MAX_RECIPES_SHOWN)
        m["recipes"] = sorted(m["recipes"], key=lambda r: (r["state"] != "certified",
                                                           -sum(not p["departing"] for p in r["peers"]),
                                                           r["recipe_digest"]))[:MAX_RECIPES_SHOWN]
    doc["relays_omitted"] = max(0, len(doc["relays"]) - MAX_RELAYS_SHOWN)
    doc["relays"] = doc["relays"][:MAX_RELAYS_SHOWN]
    doc["generated_at_ms"] = now_ms
    doc["totals"] = {"models": len(doc["models"]), "recipes": sum(len(m["recipes"]) for m in doc["models"]),
                     "peers": len(peers), "live": live, "departing": departing, "relays": len(doc["relays"])}
    return doc


def empty_doc(trust: TrustPolicy) -> dict[str, Any]:
    return {"relays": [], "trusted_certifiers": sorted(trust.certifiers), "models": [], "generated_at_ms": None,
            "totals": {"models": 0, "recipes": 0, "peers": 0, "live": 0, "departing": 0, "relays": 0}}


# --- what changed between two surveys (pure) ---------------------------------------------------


def event(at_ms: int, kind: str, text: str, peer_id: str | None = None) -> dict[str, Any]:
    return {"at_ms": at_ms, "kind": kind, "text": text, "peer_id": peer_id}


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _label(p: Mapping[str, Any]) -> str:
    short = p["peer_id"][-8:]
    return f"{p['name']} ({short})" if p.get("name") else short


def _span(p: Mapping[str, Any]) -> str:
    a, b = p["layers"]
    return f"layers {a}-{b - 1}"


def _ranges(pairs) -> str:
    return ", ".join(f"{a}-{b - 1}" if b - a > 1 else f"{a}" for a, b in pairs)


def _index(doc: Mapping[str, Any]):
    recipes, peers = {}, {}
    for m in doc["models"]:
        for r in m["recipes"]:
            where = f"{m['name'] or m['model_digest'][:12]} recipe {r['recipe_digest'][:12]}"
            recipes[(m["model_digest"], r["recipe_digest"])] = (where, r)
            for p in r["peers"]:
                peers[(m["model_digest"], r["recipe_digest"], p["peer_id"])] = (where, p)
    return recipes, peers, {r["peer_id"]: r for r in doc["relays"]}


def diff_events(old: Mapping[str, Any] | None, new: Mapping[str, Any], now_ms: int) -> list[dict[str, Any]]:
    """What changed from survey ``old`` to ``new`` (monitor docs), as events at ``now_ms``.
    The first survey is one summary event, not one per peer."""
    if old is None:
        t = new["totals"]
        return [event(now_ms, "started", f"first survey: {_count(t['peers'], 'peer')} serving "
                                         f"{_count(t['models'], 'model')}, {_count(t['relays'], 'relay')}")]
    out = []
    old_recipes, old_peers, old_relays = _index(old)
    new_recipes, new_peers, new_relays = _index(new)
    for key in sorted(new_peers.keys() | old_peers.keys()):
        pid = key[2]
        if key not in old_peers:
            where, p = new_peers[key]
            out.append(event(now_ms, "peer-appeared", f"{_label(p)} appeared: {where}, {_span(p)}, {p['reachability']}",
                             pid))
            if p["departing"]:
                out.append(event(now_ms, "peer-departing", f"{_label(p)} announced its departure ({where})", pid))
            continue
        where, was = old_peers[key]
        if key not in new_peers:
            how = ("left after announcing its departure" if was["departing"]
                   else "vanished: its report expired or was withdrawn without a departure")
            out.append(event(now_ms, "peer-gone", f"{_label(was)} {how} ({where}, {_span(was)})", pid))
            continue
        _, p = new_peers[key]
        if p["departing"] and not was["departing"]:
            out.append(event(now_ms, "peer-departing", f"{_label(p)} announced its departure ({where}, {_span(p)})",
                             pid))
        if p["reachability"] != was["reachability"]:
            out.append(event(now_ms, "reachability", f"{_label(p)} reachability: {was['reachability']} -> "
                                                     f"{p['reachability']}", pid))
    for key in sorted(new_recipes):
        where, r = new_recipes[key]
        if key not in old_recipes:
            state = f"certified by {r['certified_by']}" if r["state"] == "certified" else "dark"
            out.append(event(now_ms, "recipe-appeared", f"{where} appeared ({state})"))
            continue
        _, was = old_recipes[key]
        live = any(not p["departing"] for p in r["peers"])
        if r["state"] == "certified" and r["certified_by"] != was["certified_by"]:
            out.append(event(now_ms, "certified", f"{where} certified by {r['certified_by']} ({r['method']})"))
        elif r["state"] == "dark" and was["state"] == "certified" and live:
            # (a recipe whose last peers are leaving is not looked up: no news about its certificate)
            out.append(event(now_ms, "uncertified", f"{where} is no longer certified here (was by "
                                                    f"{was['certified_by']}): expired, or no longer found"))
        holes, had = r["coverage"]["holes"], was["coverage"]["holes"]
        if holes != had:
            out.append(event(now_ms, "coverage", f"{where}: layers {_ranges(holes)} uncovered" if holes
                             else f"{where}: every layer covered again"))
    for pid in sorted(new_relays.keys() - old_relays.keys()):
        out.append(event(now_ms, "relay-appeared", f"relay {pid[-8:]} appeared at {new_relays[pid]['addr']}", pid))
    for pid in sorted(old_relays.keys() - new_relays.keys()):
        out.append(event(now_ms, "relay-gone", f"relay {pid[-8:]} at {old_relays[pid]['addr']} vanished", pid))
    return _collapse(out, now_ms)


def _collapse(events: list[dict[str, Any]], now_ms: int) -> list[dict[str, Any]]:
    """At most MAX_EVENTS_OF_A_KIND events of one kind from one survey; the rest become
    one summary, so a burst of forged identities cannot flush the log."""
    kept, extra = [], {}
    seen: dict[str, int] = {}
    for e in events:
        seen[e["kind"]] = seen.get(e["kind"], 0) + 1
        if seen[e["kind"]] <= MAX_EVENTS_OF_A_KIND:
            kept.append(e)
        else:
            extra[e["kind"]] = extra.get(e["kind"], 0) + 1
    for kind, n in extra.items():
        kept.append(event(now_ms, kind, f"and {n} more {kind} events in this survey"))
    return kept


# --- the survey loop ---------------------------------------------------------------------------


class Monitor:
    """The latest doc and a bounded log of events. ``survey`` is the network call
    (a double in tests); one failing keeps the last doc, marked stale."""

    def __init__(self, survey: Callable[[], Awaitable[Survey]], trust: TrustPolicy, *, interval_s: float = 3.0,
                 max_events: int = MAX_EVENTS, clock: Callable[[], int] | None = None) -> None:
        from meshnet_p2p.core.records import wall_ms

        self._survey, self.trust, self.interval_s, self.clock = survey, trust, interval_s, clock or wall_ms
        self.events: deque[dict[str, Any]] = deque(maxlen=max_events)
        self.doc: dict[str, Any] | None = None
        self.status: dict[str, Any] = {"ok": None, "error": None, "last_ok_ms": None, "took_ms": None, "surveys": 0}
        self.errors: Counter[str] = Counter()  # loop_errors_survey: a failure the survey loop caught

    def current(self) -> dict[str, Any]:
        """What ``/api/swarm`` answers: the last good doc, how fresh it is, events newest first."""
        return {**(self.doc or empty_doc(self.trust)), "now_ms": self.clock(),
                "survey": {**self.status, "interval_s": self.interval_s}, "events": list(reversed(self.events))}

    def record(self, survey: Survey | None, error: str | None, started_ms: int) -> None:
        """Take one survey's outcome (pure but for the state it updates)."""
        now = self.clock()
        if survey is None:
            if self.status["ok"] is not False:  # one event per failing stretch, not one per try
                self.events.append(event(now, "survey-failed", f"survey failed: {error}"))
            self.status.update(ok=False, error=error)
            return
        try:
            doc = monitor_doc(survey, self.trust, now_ms=now)
        except Exception as e:  # a doc that cannot be built is a failed survey, never the end of the role
            self.record(None, f"cannot show this survey: {type(e).__name__}", started_ms)
            return
        if self.status["ok"] is False:
            self.events.append(event(now, "survey-recovered", "survey works again"))
        self.events.extend(diff_events(self.doc, doc, now))
        self.doc = doc
        self.status.update(ok=True, error=None, last_ok_ms=now, took_ms=now - started_ms,
                           surveys=self.status["surveys"] + 1)

    async def refresh(self) -> None:
        import trio

        started = self.clock()
        try:
            with trio.fail_after(SURVEY_TIMEOUT_S), unwrap_errors(MeshnetError, OSError):
                survey = await self._survey()
        except (MeshnetError, OSError, trio.TooSlowError) as e:
            self.record(None, sanitize(str(e) or type(e).__name__, 300), started)
            return
        self.record(survey, None, started)

    async def run(self, *, task_status=None) -> None:
        import trio

        if task_status is not None:  # (nursery.start passes it)
            task_status.started()
        from meshnet_p2p.core.guard import Guard

        guard = Guard("survey", self.errors)
        while True:  # until the role's nursery is cancelled (a signal)
            async with guard:  # (a survey's failures are the survey's; this is for anything else)
                await self.refresh()
            await trio.sleep(self.interval_s)


# --- the web app -------------------------------------------------------------------------------


def _csp() -> str:
    """Only the page's own inline script and style run, and it talks to this origin
    alone: nothing is loaded from anywhere else, injected markup included."""
    from .monitor_page import SCRIPT, STYLE

    def digest(text: str) -> str:
        return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"

    return (f"default-src 'none'; script-src {digest(SCRIPT)}; style-src {digest(STYLE)}; connect-src 'self'; "
            "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def create_app(current: Callable[[], dict[str, Any]]):
    from fastapi import FastAPI
    from fastapi.responses import HTMLResponse, JSONResponse

    from .monitor_page import PAGE

    # no /docs: FastAPI's docs page loads its scripts from a CDN
    app = FastAPI(title="meshnet-p2p monitor", docs_url=None, redoc_url=None, openapi_url=None)
    page_headers = {"Content-Security-Policy": _csp(), "Cache-Control": "no-store",
                    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}

    @app.get("/")
    async def page():
        return HTMLResponse(PAGE, headers=page_headers)

    @app.get("/api/swarm")
    async def swarm():
        return JSONResponse(current(), headers={"Cache-Control": "no-store"})

    @app.get("/healthz")
    async def healthz():
        s = current()["survey"]
        return JSONResponse({"ok": s["ok"] is True, "last_ok_ms": s["last_ok_ms"], "error": s["error"]},
                            status_code=200 if s["ok"] is True else 503)

    return app


async def serve_app(nursery: trio.Nursery, app, host: str, port: int) -> str:
    """Serve ``app`` in ``nursery`` (until it is cancelled); the URL it is bound at."""
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = None
    bound = await nursery.start(serve, app, config)
    return bound[0]


# --- the role ----------------------------------------------------------------------------------


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("monitor", help="serve a live web page of the swarm: models, coverage, peers, events")
    add_bootstrap(p, "bootstrap peers (repeatable; default $MESHNET_BOOTSTRAP)")
    p.add_argument("--listen", default=DEFAULT_LISTEN, help=f"HOST:PORT for the web page (port 0: any; default "
                   f"{DEFAULT_LISTEN})")
    add_trust(p)
    p.add_argument("--interval", type=_interval, default=3.0, metavar="SECONDS",
                   help="seconds between surveys of the swarm (default 3)")
    add_metrics(p)
    return p


def _interval(text: str) -> float:
    value = number(text)
    if not 0.1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"{text!r} must be between 0.1 and 3600")
    return value


async def _serve(seeds: list, trust: TrustPolicy, host: str, port: int, interval_s: float, print_line,
                 metrics: str | None = None) -> None:
    import trio

    from meshnet_p2p.core.identity import Identity
    from meshnet_p2p.core.lifecycle import until_signalled
    from meshnet_p2p.core.local_addrs import listen_urls
    from meshnet_p2p.swarm.node import start_node
    from .status import survey_node

    async with trio.open_nursery() as nursery:
        node = await start_node(nursery, Identity.generate(), bootstrap=seeds, client_mode=True, follow_all=True)
        monitor = Monitor(lambda: survey_node(node, trust, keep_departing=True), trust, interval_s=interval_s)
        await nursery.start(monitor.run)
        bound = await serve_app(nursery, create_app(monitor.current), host, port)
        for url in listen_urls(host, bound):  # on a wildcard: a line per local address, loopback last
            print_line(f"listening on {url}/")  # like every long-running role
        if metrics is not None:
            from .metrics import DhtCollector, metrics_url, serve_metrics

            print_line(f"metrics on {metrics_url(*await serve_metrics(nursery, metrics, 'monitor', DhtCollector(node)))}")
        await until_signalled()
        nursery.cancel_scope.cancel()


def run(args: argparse.Namespace, print_line=lambda line: print(line, flush=True)) -> int:
    import trio

    from meshnet_p2p.core.lifecycle import catching_signals
    from meshnet_p2p.trust.policy import TrustPolicy
    from meshnet_p2p.swarm.node import bootstrap_addrs, parse_listen

    host, port = parse_listen(args.listen)
    metrics = metrics_listen(args)  # a bad value fails before anything starts
    seeds = bootstrap_addrs(args.bootstrap)
    if not seeds:
        raise MeshnetError("monitor needs bootstrap peers (--bootstrap MULTIADDR or MESHNET_BOOTSTRAP)")
    trust = TrustPolicy.default(seeds, extra=args.trust, trust_file=args.trust_file)
    try:
        with unwrap_errors(MeshnetError, OSError):
            trio.run(catching_signals, _serve, seeds, trust, host, port, args.interval, print_line, metrics)
    except OSError as e:  # the port taken, an address not ours
        raise MeshnetError(f"cannot serve the monitor on {args.listen}: {e.strerror or e}") from None
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m meshnet_p2p.roles.monitor ...``: the role without cli.py."""
    class Alone:  # add_parser's subparsers, for a parser of its own
        def add_parser(self, name, help):
            return argparse.ArgumentParser(prog="python -m meshnet_p2p.roles.monitor", description=help)

    args = add_parser(Alone()).parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return run(args)
    except MeshnetError as e:
        print(f"error: {sanitize(e, 4000)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
