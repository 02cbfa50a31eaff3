"""`meshnet-peer monitor`: the pure parts (doc, events, bounded log), the page
with 300 peers in headless Chromium, and the page following a real swarm."""

import json
import os
import pathlib
import shutil
import subprocess
import tempfile
import urllib.request
from contextlib import contextmanager

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from meshnet_p2p.swarm.capability import CapabilityReport
from meshnet_p2p.trust.policy import Certificate, TrustPolicy
from meshnet_p2p.engine.recipe import recipe_digest
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.roles.monitor import MAX_EVENTS, Monitor, create_app, diff_events, layer_counts, monitor_doc, serve_app
from meshnet_p2p.core.multiaddr import Multiaddr
from meshnet_p2p.swarm.node import TYPES
from meshnet_p2p.roles.peer_process import Swarm
from meshnet_p2p.swarm.placement import Span
from meshnet_p2p.core.records import RecordVerifier, wall_ms
from meshnet_p2p.swarm.relay_offers import circuit_addr, sign_relay_record
from meshnet_p2p.roles.status import Survey
from meshnet_p2p.swarm.view import build_view
from meshnet_p2p.testing import FAKE_CERT_PEM

from tests.swarm import Proc

ROOT = pathlib.Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / ".ci" / "artifacts"
AXES = json.loads((pathlib.Path(__file__).parent / "data" / "recipe_vectors.json").read_text())["recipes"][0]["axes"]
ODD = {**AXES, "n_ubatch": 32}
GOOD, DARK = recipe_digest(AXES), recipe_digest(ODD)
MODEL = "ab" * 32
N_LAYER = 30
CERTIFIER = Identity.from_seed(b"\x07" * 32)
TRUST = TrustPolicy(frozenset({str(CERTIFIER.peer_id)}))
LIMITS = {"max_reservations": 128, "max_connections_per_peer": 16, "bytes_per_second_per_peer": 64_000_000}


# --- signed records, as the DHT would deliver them ----------------------------------------------


def signed_report(ident: Identity, layers, *, recipe=GOOD, axes=AXES, name="", relay=None, departing=False,
                  load=None, now_ms=None, model=MODEL):
    """A capability report signed by ``ident`` and verified as a node verifies it."""
    now = now_ms or wall_ms()
    addr = (circuit_addr(relay, ident.peer_id) if relay else
            str(Multiaddr.for_socket("127.0.0.1", "tcp", 7000, ident.peer_id)))
    rep = CapabilityReport(model, recipe, tuple(layers), (addr,), throughput=42.5, free_sessions=3,
                           kv_tokens_free=8192, relay=relay, tls_cert=FAKE_CERT_PEM, public_name=name,
                           departing=departing, recipe=axes, recipe_labels={"recipe_name": "default"}, load=load)
    return RecordVerifier(TYPES).verify(rep.sign(ident, seq=now, now_ms=now), now)


def signed_relay(ident: Identity, port: int, reservations: int):
    now = wall_ms()
    addr = Multiaddr.for_socket("10.1.0.1", "tcp", port, ident.peer_id)
    load = {"reservations_now": reservations, "circuits_now": 2, "spliced": 40, "bytes": 123_456_789, "refused": 1}
    return RecordVerifier(TYPES).verify(sign_relay_record(ident, addr, LIMITS, load, now_ms=now), now)


def survey_of(reports, relays=(), certified=True) -> Survey:
    view = build_view(MODEL, N_LAYER, reports, [], TRUST)
    for r in view.recipes:  # a certificate's evidence is certification's own tests' business
        if certified and r.recipe_digest == GOOD:
            r.certificate = Certificate(MODEL, GOOD, str(CERTIFIER.peer_id), "whole-model", wall_ms(), ())
    return Survey(list(relays), [("SmolLM2-135M-Instruct", view)])


def doc_of(reports, relays=(), certified=True, now_ms=1000):
    return monitor_doc(survey_of(reports, relays, certified), TRUST, now_ms=now_ms)


def peers_of(doc):
    return {p["peer_id"]: p for m in doc["models"] for r in m["recipes"] for p in r["peers"]}


# --- pure: the doc -------------------------------------------------------------------------------


def test_layer_counts_are_runs_of_live_peers_per_layer():
    spans = [Span("a", 0, 10), Span("b", 5, 20), Span("c", 25, 40), Span("d", 0, 30, departing=True)]
    assert layer_counts(spans, 30) == [[0, 5, 1], [5, 10, 2], [10, 20, 1], [20, 25, 0], [25, 30, 1]]
    assert layer_counts([], 4) == [[0, 4, 0]]
    # a claim of 100,000 layers costs one run, not 100,000 numbers
    assert layer_counts([Span("a", 0, 100_000)], 100_000) == [[0, 100_000, 1]]


def test_the_doc_names_each_peer_its_load_reachability_and_the_recipes_state():
    a, b, c = Identity.generate(), Identity.generate(), Identity.generate()
    relay = str(Multiaddr.for_socket("10.1.0.1", "tcp", 4002, Identity.generate().peer_id))
    load = {"sessions": 2, "rows_per_pass": 1.5, "tokens_per_s": 31.25, "busy": 0.4}
    doc = doc_of([signed_report(a, (0, 15), name="alice", load=load), signed_report(b, (15, 30), relay=relay),
                  signed_report(c, (15, 30), departing=True)], [signed_relay(Identity.generate(), 4002, 3)])
    [model] = doc["models"]
    [recipe] = model["recipes"]
    assert recipe["state"] == "certified" and recipe["certified_by"] == str(CERTIFIER.peer_id)
    assert recipe["coverage"] == {"covered": [[0, 30]], "holes": []}
    assert recipe["layer_counts"] == [[0, 30, 1]]  # the departing peer does not count: one run of 1
    peers = peers_of(doc)
    pa, pb, pc = peers[str(a.peer_id)], peers[str(b.peer_id)], peers[str(c.peer_id)]
    assert pa["name"] == "alice" and pa["load"] == load and pa["reachability"] == "direct"
    assert pb["short_id"] == str(b.peer_id)[-8:] and pb["load"] is None and pb["reachability"] == f"relay {relay}"
    assert pc["departing"] and "rtt_ms" not in pa  # the monitor does not probe
    assert doc["totals"] == {"models": 1, "recipes": 1, "peers": 3, "live": 2, "departing": 1, "relays": 1}
    assert doc["relays"][0]["load"]["reservations_now"] == 3
    json.dumps(doc)  # what /api/swarm sends


# --- pure: what changed --------------------------------------------------------------------------


def kinds(events):
    return [(e["kind"], e["peer_id"]) for e in events]


def test_the_first_survey_is_one_summary_event():
    doc = doc_of([signed_report(Identity.generate(), (0, 30)) for _ in range(5)])
    [e] = diff_events(None, doc, 77)
    assert e["kind"] == "started" and "5 peers" in e["text"] and e["at_ms"] == 77


def test_events_for_peers_that_appear_depart_vanish_and_change_reachability():
    a, b, c, d = (Identity.generate() for _ in range(4))
    relay = str(Multiaddr.for_socket("10.1.0.1", "tcp", 4002, Identity.generate().peer_id))
    before = doc_of([signed_report(a, (0, 10), name="alice"), signed_report(b, (10, 20)),
                     signed_report(c, (20, 30)), signed_report(d, (0, 30), departing=True)])
    e = Identity.generate()
    after = doc_of([signed_report(a, (0, 10), name="alice", relay=relay), signed_report(b, (10, 20), departing=True),
                    signed_report(e, (20, 30))])
    events = diff_events(before, after, 5)
    got = set(kinds(events))
    assert {("reachability", str(a.peer_id)), ("peer-departing", str(b.peer_id)), ("peer-gone", str(c.peer_id)),
            ("peer-gone", str(d.peer_id)), ("peer-appeared", str(e.peer_id))} <= got
    text = {k: ev["text"] for ev in events for k in [(ev["kind"], ev["peer_id"])]}
    assert f"direct -> relay {relay}" in text[("reachability", str(a.peer_id))] and "alice" in text[
        ("reachability", str(a.peer_id))]
    assert "vanished" in text[("peer-gone", str(c.peer_id))]  # no departure announced: its report expired
    assert "after announcing its departure" in text[("peer-gone", str(d.peer_id))]
    # b departing leaves layers 10-19 to nobody
    assert any(ev["kind"] == "coverage" and "layers 10-19 uncovered" in ev["text"] for ev in events)
    assert all(ev["at_ms"] == 5 for ev in events)
    assert diff_events(after, after, 6) == []


def test_events_for_certification_and_relays():
    a = Identity.generate()
    r1, r2 = Identity.generate(), Identity.generate()
    dark = doc_of([signed_report(a, (0, 30))], [signed_relay(r1, 4002, 0)], certified=False)
    cert = doc_of([signed_report(a, (0, 30))], [signed_relay(r2, 4003, 0)])
    events = diff_events(dark, cert, 9)
    assert ("certified", None) in kinds(events)
    assert ("relay-appeared", str(r2.peer_id)) in kinds(events) and ("relay-gone", str(r1.peer_id)) in kinds(events)
    assert [k for k, _ in kinds(diff_events(cert, dark, 10)) if "cert" in k] == ["uncertified"]
    # a new dark recipe is news, with its state
    odd = doc_of([signed_report(a, (0, 30)), signed_report(Identity.generate(), (0, 30), recipe=DARK, axes=ODD)])
    [new] = [e for e in diff_events(cert, odd, 11) if e["kind"] == "recipe-appeared"]
    assert DARK[:12] in new["text"] and "(dark)" in new["text"]


async def test_the_event_log_is_bounded_and_survey_failures_are_one_event_per_stretch():
    state = {"n": 0, "fail": False}

    async def survey():
        if state["fail"]:
            raise OSError("network is unreachable")
        state["n"] += 1  # a new peer every survey: one event each
        return survey_of([signed_report(Identity.from_seed(bytes([i]) * 32), (0, 30)) for i in range(state["n"])])

    m = Monitor(survey, TRUST, max_events=10)
    for _ in range(25):
        await m.refresh()
    assert len(m.events) == 10 and m.current()["events"][0]["kind"] == "peer-appeared"
    state["fail"] = True
    for _ in range(3):
        await m.refresh()
    doc = m.current()
    assert [e["kind"] for e in doc["events"][:2]] == ["survey-failed", "peer-appeared"]
    assert doc["survey"]["ok"] is False and "unreachable" in doc["survey"]["error"]
    assert doc["totals"]["peers"] == 25  # the last good survey stays on the page, marked stale
    state["fail"] = False
    await m.refresh()
    assert [e["kind"] for e in m.current()["events"][:2]] == ["peer-appeared", "survey-recovered"]
    assert MAX_EVENTS == 200 and Monitor(survey, TRUST).events.maxlen == MAX_EVENTS


# --- the page, in headless Chromium --------------------------------------------------------------

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
# no network of its own: without these Chromium keeps trying to reach Google (and this machine's network is closed)
CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--no-first-run", "--disable-quic", "--window-size=1280,800")


def require_browser() -> None:
    """Skip when Chromium, its driver or selenium is missing; fail instead when
    MESHNET_REQUIRE_TOOLS is set (CI installs them: .ci/run)."""
    missing = [f"{path} (Debian's {pkg})" for path, pkg in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver"))
               if not shutil.which(path)]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("the selenium package")
    if not missing:
        return
    reason = "headless browser tests need " + ", ".join(missing)
    if os.environ.get("MESHNET_REQUIRE_TOOLS"):
        pytest.fail(f"MESHNET_REQUIRE_TOOLS is set: {reason}")
    pytest.skip(reason)


@contextmanager
def browser():
    """A headless Chromium driven by Debian's chromedriver (selenium never downloads
    one), in a fresh profile; quit however the test ends, which ends Chromium too."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    with tempfile.TemporaryDirectory(prefix="meshnet-chromium-") as profile:
        opts = webdriver.ChromeOptions()
        opts.binary_location = CHROMIUM
        for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
            opts.add_argument(flag)
        opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER, log_output=subprocess.DEVNULL),
                                  options=opts)
        try:
            # the screenshot's viewport is 1280x800 exactly (the window's size would include its frame)
            driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                                   {"width": 1280, "height": 800, "deviceScaleFactor": 1, "mobile": False})
            yield driver
        finally:
            driver.quit()


def wait_for(driver, condition, what: str, timeout: float = 60):
    """Poll ``condition(driver)`` until it is truthy (bounded)."""
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.2).until(condition, f"the page never showed {what}")


# Each read is one script, so it sees one version of the DOM (an update replaces rows and cells).


def rows(driver):
    return driver.execute_script(
        "return [...document.querySelectorAll('tr[data-peer-id]')].map(r => [r.dataset.peerId, r.dataset.state])")


def bar(driver, bar_id: str) -> dict | None:
    return driver.execute_script(
        "const b = document.getElementById(arguments[0]);"
        "return b && {holes: b.dataset.holes, uncovered: b.dataset.uncovered,"
        "             counts: [...b.querySelectorAll('.cell')].map(c => c.dataset.count)}", bar_id)


def count(driver, selector: str) -> int:
    return driver.execute_script("return document.querySelectorAll(arguments[0]).length", selector)


def attrs(driver, selector: str, name: str) -> list:
    return driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map(e => e.getAttribute(arguments[1]))", selector, name)


def screenshot(driver, name: str) -> pathlib.Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    assert driver.save_screenshot(str(path)), path
    return path


def no_page_errors(driver) -> None:
    """No script error, CSP violation or failed load in the page's console."""
    severe = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not severe, severe


def bar_id(doc, recipe=GOOD) -> str:
    return f"coverage-{doc['models'][0]['model_digest']}-{recipe}"


def synthetic_swarm(n: int):
    """``n`` signed reports of one model: most serve the certified recipe (some through
    relays, some named, a few departing), the rest a dark recipe with a hole."""
    relays = [Identity.from_seed(bytes([200 + i]) * 32) for i in range(2)]
    relay_addrs = [str(Multiaddr.for_socket("10.1.0.1", "tcp", 4002 + i, r.peer_id)) for i, r in enumerate(relays)]
    reports = []
    for i in range(n):
        ident = Identity.from_seed(i.to_bytes(4, "big") * 8)
        dark = i >= n - 20
        start = (i * 7) % (20 if dark else N_LAYER)  # the dark recipe leaves layers 26-29 to nobody
        end = min(26 if dark else N_LAYER, start + 3 + i % 8)
        load = {"sessions": i % 5, "rows_per_pass": round(1 + (i % 7) / 3, 2), "tokens_per_s": 10.0 + i % 40,
                "busy": round((i % 10) / 10, 2)}
        reports.append(signed_report(ident, (start, end), recipe=DARK if dark else GOOD, axes=ODD if dark else AXES,
                                     name=f"volunteer-{i:03d}" if i % 2 else "",
                                     relay=relay_addrs[i % 2] if i % 11 == 0 else None,
                                     departing=i % 60 == 59, load=load if i % 13 else None))
    return reports, [signed_relay(r, 4002 + i, 3 + i) for i, r in enumerate(relays)]


async def browse_monitor(survey, browse):
    """The real monitor (doc, events, app, page) over ``survey`` (the network survey
    replaced), served on loopback; ``browse(url)`` runs in a thread; what it returns."""
    monitor = Monitor(survey, TRUST, interval_s=0.5)
    async with trio.open_nursery() as nursery:
        await nursery.start(monitor.run)
        url = await serve_app(nursery, create_app(monitor.current), "127.0.0.1", 0)
        result = await trio.to_thread.run_sync(browse, url)
        nursery.cancel_scope.cancel()
    return result


async def test_the_page_shows_300_peers_readably(tmp_path):
    require_browser()
    reports, relays = synthetic_swarm(300)
    current = {"reports": reports}

    async def survey():  # the network survey replaced: the rest (doc, events, app, page) is the real thing
        return survey_of(current["reports"], relays)

    def browse(url):
        with browser() as d:
            d.get(f"{url}/")
            wait_for(d, lambda d: len(rows(d)) == 300, "300 peer rows")
            doc = json.loads(urllib.request.urlopen(f"{url}/api/swarm", timeout=30).read())
            assert {p for p, _ in rows(d)} == set(peers_of(doc)) and len(peers_of(doc)) == 300
            good, dark = bar(d, bar_id(doc)), bar(d, bar_id(doc, DARK))
            assert len(good["counts"]) == N_LAYER and "0" not in good["counts"] and good["holes"] == "0"
            assert dark["holes"] == "4" and dark["uncovered"] == "26-29" and dark["counts"][26:] == ["0"] * 4
            assert count(d, "tr[data-state=departing]") == 5
            assert attrs(d, "[data-state=certified]", "data-certifier") == [str(CERTIFIER.peer_id)]
            assert count(d, "[data-relay-id]") == 2
            # readable: the page is not a giant list of lanes; the tables scroll inside themselves
            assert d.execute_script("return document.documentElement.scrollHeight") < 2000
            assert d.execute_script("return document.documentElement.scrollWidth") <= 1280
            assert count(d, ".lane") <= 12
            wait_for(d, lambda d: attrs(d, "#freshness", "data-state") == ["ok"], "a fresh update")
            shot = screenshot(d, "monitor-300.png")
            # the filter narrows the table, and survives the next updates
            box = d.find_element("css selector", f"#{bar_id(doc).replace('coverage', 'recipe')} input")
            box.send_keys("volunteer-00")
            wait_for(d, lambda d: len(rows(d)) == 5 + 20, "the filtered rows")  # 001..009 odd, and the dark 20
            seen = int(d.find_element("tag name", "body").get_attribute("data-updates"))
            wait_for(d, lambda d: int(d.find_element("tag name", "body").get_attribute("data-updates")) > seen + 1,
                     "two more updates")
            assert len(rows(d)) == 25 and box.get_attribute("value") == "volunteer-00"
            box.clear()
            box.send_keys(" ")  # (clear() sends no input event)
            # a peer leaves the next survey: the page follows without a reload
            gone = reports[1].content["peer_id"]
            current["reports"] = [r for r in reports if r.content["peer_id"] != gone]
            wait_for(d, lambda d: gone not in {p for p, _ in rows(d)} and len(rows(d)) == 299, "the peer gone")
            wait_for(d, lambda d: gone in attrs(d, "#events li[data-kind=peer-gone]", "data-subject"),
                     "the peer-gone event")
            no_page_errors(d)
            return shot

    shot = await browse_monitor(survey, browse)
    assert shot.stat().st_size > 10_000


async def test_what_forged_reports_can_name_cannot_take_over_the_page(tmp_path):
    """Reports cost nothing to sign: markup in a name stays text, a model whose
    digest shares the real one's first characters gets its own section, and a
    span claimed far beyond the model's layers stays inside the bar."""
    require_browser()
    twin = MODEL[:24] + "cd" * 20  # the same first 24 characters as the real model's digest
    markup = '<img src=x onerror="document.title=1">'
    real = [signed_report(Identity.from_seed(bytes([i + 1]) * 32), (a, b), name="honest")
            for i, (a, b) in enumerate(((0, 10), (10, 20), (20, 30)))]
    forged = [signed_report(Identity.from_seed(b"\x61" * 32), (0, 30), name=markup, model=twin),
              signed_report(Identity.from_seed(b"\x62" * 32), (99_990, 100_000), name="far away")]

    async def survey():
        good = survey_of(real + forged[1:])
        return Survey(good.relays, [*good.models, ("twin", build_view(twin, N_LAYER, forged[:1], [], TRUST))])

    def browse(url):
        with browser() as d:
            d.get(f"{url}/")
            wait_for(d, lambda d: len(rows(d)) == 5, "every peer of both models")
            assert count(d, "section.model") == 2 and count(d, "article.recipe") == 2
            assert count(d, "img") == 0 and d.title == "meshnet monitor"  # the markup is text
            assert markup in d.find_element("css selector", "body").text
            assert d.execute_script("return document.documentElement.scrollWidth") <= 1280
            doc = json.loads(urllib.request.urlopen(f"{url}/api/swarm", timeout=30).read())
            assert bar(d, bar_id(doc))["holes"] == "0"  # the real model's bar is its own, whole
            screenshot(d, "monitor-forged.png")
            no_page_errors(d)

    await browse_monitor(survey, browse)


def test_a_survey_shows_a_bounded_page_whatever_the_dht_holds():
    from meshnet_p2p.roles.monitor import MAX_EVENTS_OF_A_KIND, MAX_PEERS_SHOWN

    many = [signed_report(Identity.from_seed(i.to_bytes(4, "big") * 8), (0, 30)) for i in range(MAX_PEERS_SHOWN + 40)]
    doc = doc_of(many)
    [recipe] = doc["models"][0]["recipes"]
    assert len(recipe["peers"]) == MAX_PEERS_SHOWN and recipe["peers_omitted"] == 40
    assert recipe["layer_counts"] == [[0, N_LAYER, MAX_PEERS_SHOWN + 40]]  # the bar counts them all
    events = diff_events(doc_of(many[:1]), doc, 5)  # hundreds appear at once: the log keeps its head
    appeared = [e for e in events if e["kind"] == "peer-appeared"]
    assert len(appeared) == MAX_EVENTS_OF_A_KIND + 1 and appeared[-1]["text"].startswith("and ")


async def test_the_page_and_json_carry_no_outside_references():
    monitor = Monitor(lambda: None, TRUST)
    async with trio.open_nursery() as nursery:
        url = await serve_app(nursery, create_app(monitor.current), "127.0.0.1", 0)

        def get(path):
            with urllib.request.urlopen(f"{url}{path}", timeout=30) as r:
                return r.status, dict(r.headers), r.read().decode()

        status, headers, page = await trio.to_thread.run_sync(get, "/")
        assert status == 200 and "http://" not in page and "https://" not in page and "src=" not in page
        assert "default-src 'none'" in headers["content-security-policy"]
        status, _, body = await trio.to_thread.run_sync(get, "/api/swarm")
        doc = json.loads(body)
        assert doc["survey"]["ok"] is None and doc["models"] == [] and doc["events"] == []
        with pytest.raises(urllib.error.HTTPError) as e:  # no survey yet
            await trio.to_thread.run_sync(get, "/healthz")
        assert e.value.code == 503
        with pytest.raises(urllib.error.HTTPError) as e:  # FastAPI's docs page would load a CDN's scripts
            await trio.to_thread.run_sync(get, "/docs")
        assert e.value.code == 404
        nursery.cancel_scope.cancel()


# --- end to end: a real swarm, the monitor as its own process ------------------------------------


def test_the_page_follows_a_real_swarm_as_a_peer_leaves(tmp_path):
    require_browser()
    env = {**os.environ, "MESHNET_CACHE_DIR": str(tmp_path)}  # shards cut for this test only
    with Swarm(["0:10", "10:20", "20:30"], "--threads", "1", env=env, process=Proc, timeout=120,
               boot_identity=str(tmp_path / "bootstrap.key")) as swarm:
        swarm.certify()
        ids = [j.peer_id for j in swarm.joins]
        monitor = Proc("monitor", "--bootstrap", swarm.addr, "--listen", "127.0.0.1:0", "--interval", "1",
                       "--metrics", "127.0.0.1:0")
        try:
            url = monitor.wait_line("listening on ", 60).removeprefix("listening on ")
            metrics = monitor.wait_line("metrics on ", 60).removeprefix("metrics on ")
            with browser() as d:
                d.get(url)

                def whole(d):
                    live = dict(rows(d))
                    return (sorted(live) == sorted(ids) and set(live.values()) == {"live"}
                            and attrs(d, ".bar", "data-holes") == ["0"] and count(d, "[data-state=certified]") == 1)

                wait_for(d, whole, "every peer live, the bar whole and the recipe certified", timeout=120)
                doc = json.loads(urllib.request.urlopen(f"{url}api/swarm", timeout=30).read())
                [recipe] = doc["models"][0]["recipes"]
                coverage = bar_id(doc, recipe["recipe_digest"])
                assert recipe["certified_by"] == swarm.boot.peer_id and recipe["coverage"]["holes"] == []
                assert bar(d, coverage)["counts"] == ["1"] * 30

                leaving = swarm.joins[1]
                assert leaving.stop() == 0  # SIGTERM: it announces its departure, then exits

                def left(d):
                    state = dict(rows(d)).get(leaving.peer_id, "gone")
                    return state in ("departing", "gone") and bar(d, coverage)["uncovered"] == "10-19"

                wait_for(d, left, "the peer departing or gone, and layers 10-19 uncovered", timeout=60)
                assert {p for p, s in rows(d) if s == "live"} == {ids[0], ids[2]}
                screenshot(d, "monitor.png")
                # its departing report lives 10 s: then it is gone from the table, and the log says so
                wait_for(d, lambda d: leaving.peer_id not in dict(rows(d))
                         and leaving.peer_id in attrs(d, "#events li[data-kind=peer-gone]", "data-subject"),
                         "the peer gone", timeout=60)
                assert bar(d, coverage)["uncovered"] == "10-19"
                no_page_errors(d)
            # its own metrics: the DHT node that surveys the swarm, asking and answering
            families = {f.name: f for f in text_string_to_metric_families(
                urllib.request.urlopen(metrics, timeout=30).read().decode())}
            assert sum(s.value for s in families["meshnet_dht_requests_sent"].samples
                       if s.name.endswith("_total")) > 0
            assert any(s.labels.get("role") == "monitor" for s in families["meshnet_build_info"].samples)
        finally:
            code = monitor.stop()
        assert code == 0


async def test_a_survey_no_dht_node_answered_is_a_failed_survey_not_an_empty_swarm():
    """Cut off (a partition), a node's lookups come back empty without an error:
    the monitor must say its survey fails, not that every peer vanished."""
    from collections import Counter

    from meshnet_p2p.core.errors import MeshnetError
    from meshnet_p2p.roles.status import survey_node

    class CutOff:
        stats = Counter()

        def records(self, key):
            return []

        async def get(self, key):
            return []  # every contact timed out

    with pytest.raises(MeshnetError, match="cut off"):
        await survey_node(CutOff(), TRUST)
