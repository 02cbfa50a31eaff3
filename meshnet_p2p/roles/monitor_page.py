"""The monitor's web page: one HTML document, its CSS and JS inline, nothing
fetched from anywhere but its own ``api/swarm`` (the server's Content-Security-Policy
allows exactly these two inline blocks, by hash: see monitor._csp).

The script polls ``api/swarm`` and updates the DOM in place (the filter box,
sort order and table scroll survive each update). Every text from the network
goes in through ``textContent``, never as markup. Stable hooks for tests:
``tr[data-peer-id]`` (with ``data-state`` live|departing) per peer,
``#coverage-<model digest[:8]>-<recipe digest[:12]>`` per coverage bar (with
``data-holes``, the count of uncovered layers), ``#freshness[data-state]``,
``body[data-updates]``.
"""

STYLE = r"""
:root { --bg: #f5f6f8; --card: #fff; --ink: #1d2430; --muted: #667085; --line: #e2e5ea; --hole: #d64545;
        --ok: #2e8540; --warn: #b7791f; }
* { box-sizing: border-box; }
body { margin: 0; font: 13px/1.35 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: var(--ink);
       background: var(--bg); }
header { position: sticky; top: 0; z-index: 2; display: flex; gap: 16px; align-items: center; padding: 8px 16px;
         background: var(--ink); color: #fff; }
header h1 { font-size: 15px; margin: 0; }
#totals { color: #c9d1dc; }
.pill { margin-left: auto; padding: 2px 10px; border-radius: 10px; background: #475467; white-space: nowrap; }
.pill[data-state=ok] { background: var(--ok); }
.pill[data-state=stale] { background: var(--warn); }
.pill[data-state=error] { background: var(--hole); }
#problem { background: #fdecec; color: #8a1c1c; padding: 6px 16px; border-bottom: 1px solid #f3c2c2; }
#problem[hidden] { display: none; }
main { display: grid; grid-template-columns: minmax(0, 1fr) 330px; gap: 12px; padding: 10px 14px; }
main > * { min-width: 0; }
body.stale main { opacity: .55; }
section.model > h2 { font-size: 14px; margin: 0 0 6px; }
small, .digest { color: var(--muted); font-weight: normal; }
.digest, .mono { font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 12px; }
article.recipe { background: var(--card); border: 1px solid var(--line); border-radius: 6px; padding: 8px 10px;
                 margin-bottom: 12px; }
.rhead { display: flex; flex-wrap: wrap; gap: 4px 12px; align-items: baseline; margin-bottom: 6px; }
.state { padding: 1px 8px; border-radius: 8px; font-weight: 600; }
.state.certified { background: #e3f4e6; color: #1e6b30; }
.state.dark { background: #2b2f36; color: #f1f1f1; }
.holes { color: var(--hole); font-weight: 600; }
.covered { color: var(--ok); }
.bar { display: flex; height: 22px; border-radius: 3px; overflow: hidden; border: 1px solid #cfd5dd; }
.cell { flex: 1 1 0; min-width: 0; border-right: 1px solid rgba(255, 255, 255, .7); font-size: 10px;
        text-align: center; line-height: 20px; overflow: hidden; }
.cell:last-child { border-right: 0; }
.c0 { background: var(--hole); color: #fff; }
.c1 { background: #cdeabf; } .c2 { background: #9fd68a; } .c3 { background: #6cbf5b; }
.c4 { background: #3f9a48; color: #fff; }
.axis { position: relative; height: 13px; color: var(--muted); font-size: 10px; margin-bottom: 3px; }
.axis span { position: absolute; transform: translateX(-50%); }
.lanes { overflow: hidden; }
.lane { position: relative; height: 15px; margin-bottom: 2px; }
.span { position: absolute; top: 0; bottom: 0; background: #dce7f7; border: 1px solid #9db6dc; border-radius: 3px;
        font-size: 10px; line-height: 13px; padding: 0 3px; overflow: hidden; white-space: nowrap;
        text-overflow: ellipsis; }
.span.relayed { border-style: dashed; }
.span.departing { background: repeating-linear-gradient(45deg, #eee, #eee 4px, #ddd 4px, #ddd 8px);
                  border-color: #bbb; color: #777; }
.note { color: var(--muted); font-size: 11px; margin: 2px 0 4px; }
.tablebar { display: flex; gap: 8px; align-items: center; margin: 6px 0 4px; }
.tablebar input { width: 260px; padding: 2px 6px; font: inherit; }
.tablewrap { max-height: 250px; overflow: auto; border: 1px solid var(--line); border-radius: 4px; }
table { border-collapse: collapse; width: 100%; font-size: 12px; }
th, td { padding: 2px 5px; text-align: left; white-space: nowrap; border-bottom: 1px solid var(--line); }
th { position: sticky; top: 0; background: #eef1f5; font-weight: 600; white-space: normal; vertical-align: bottom; }
th.num { text-align: right; }
table.peers th { cursor: pointer; user-select: none; }
th[data-dir="1"]::after { content: " \25B2"; }
th[data-dir="-1"]::after { content: " \25BC"; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.departing td { color: #8a8f98; }
td.leaving { color: var(--warn) !important; font-weight: 600; }
aside .box { background: var(--card); border: 1px solid var(--line); border-radius: 6px; padding: 8px 10px;
             margin-bottom: 12px; overflow-x: auto; }
aside h2 { font-size: 13px; margin: 0 0 4px; }
.relay { padding: 3px 0; border-bottom: 1px solid var(--line); }
.relay .note { margin: 0; }
#events { list-style: none; margin: 0; padding: 0; max-height: 430px; overflow: auto; }
#events li { display: grid; grid-template-columns: auto 68px minmax(0, 1fr); gap: 6px; padding: 3px 0;
             border-bottom: 1px solid var(--line); font-size: 12px; }
#events li.note { display: block; }
#events time { color: var(--muted); font-variant-numeric: tabular-nums; }
.kind { font-size: 11px; font-weight: 600; }
.kind-peer-gone, .kind-survey-failed, .kind-uncertified, .kind-relay-gone { color: var(--hole); }
.kind-peer-departing, .kind-coverage, .kind-reachability { color: var(--warn); }
.kind-peer-appeared, .kind-certified, .kind-survey-recovered, .kind-relay-appeared, .kind-recipe-appeared {
  color: var(--ok); }
"""

SCRIPT = r"""
"use strict";
const MAX_LANES = 6;           // more peers than this deep: their spans are in the table, counts in the bar
const CELLS_UP_TO = 256;       // one cell per layer up to this many layers, else one per run of equal counts
const LABEL_CELLS_UP_TO = 64;  // a count printed in each cell while cells are wide enough
const FETCH_TIMEOUT_MS = 5000;
const state = {doc: null, fetchedAt: 0, fetchError: null, updates: 0, ui: {}};
const $ = (sel) => document.querySelector(sel);

function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") e.className = v; else e.setAttribute(k, String(v));
  }
  for (const kid of kids.flat()) {
    if (kid !== null && kid !== undefined) e.append(kid instanceof Node ? kid : String(kid));  // text, never markup
  }
  return e;
}

const short = (id) => String(id).slice(-8);
const label = (p) => p.name || p.short_id;
const fmt = (x, d = 1) => (x === null || x === undefined) ? "\u2013" : Number(x).toFixed(d);
const pct = (x) => Math.round(x * 100) + "%";
const ranges = (pairs) => pairs.map(([a, b]) => b - a > 1 ? `${a}-${b - 1}` : `${a}`).join(", ");
const layers = (p) => `${p.layers[0]}-${p.layers[1] - 1}`;
function ago(ms) {
  const s = Math.max(0, Math.round(ms / 1000));
  return s < 120 ? `${s} s` : `${Math.round(s / 60)} min`;
}
function bytes(n) {
  const units = ["B", "KB", "MB", "GB", "TB"]; let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return `${i ? n.toFixed(1) : n} ${units[i]}`;
}
function hostPort(addr) {
  const m = /^\/(?:ip4|ip6|dns4|dns6|dns)\/([^/]+)\/tcp\/(\d+)/.exec(addr);
  return m ? (m[1].includes(":") ? `[${m[1]}]:${m[2]}` : `${m[1]}:${m[2]}`) : addr;
}
const reach = (r) => r === "direct" ? "direct" : `relay ${short(r)}`;
function place(parent, child, index) {
  // a node already in place stays put: moving it would drop the focus and the scroll inside it
  const at = parent.children[index];
  if (at !== child) parent.insertBefore(child, at || null);
}

const loaded = (name) => (p) => p.load ? p.load[name] : -1;  // no load reported: sorts first
const COLUMNS = [
  {key: "peer", label: "peer", title: "public name, or the last 8 characters of its peer ID",
   get: (p) => label(p).toLowerCase()},
  {key: "layers", label: "layers", get: (p) => p.layers[0] * 1e6 + p.layers[1]},
  {key: "reach", label: "reachability", title: "direct, or through which relay", get: (p) => p.reachability},
  {key: "tps", label: "throughput tok/s", num: true, get: loaded("tokens_per_s"),
   title: "rows it computed per second lately (since its last report; its own claim)"},
  {key: "decode", label: "decode tok/s", num: true, get: (p) => p.throughput_reported,
   title: "its measured decode speed for its span, alone (its own claim)"},
  {key: "busy", label: "busy", num: true, get: loaded("busy"), title: "share of the time its engine computed lately"},
  {key: "batch", label: "batch", num: true, get: loaded("rows_per_pass"),
   title: "batch occupancy: rows per forward pass lately"},
  {key: "sessions", label: "sessions", num: true, get: loaded("sessions"), title: "sessions open now"},
  {key: "free", label: "free", num: true, get: (p) => p.free_sessions, title: "sessions it still admits"},
  {key: "kv", label: "KV free", num: true, get: (p) => p.kv_tokens_free, title: "KV-cache tokens free"},
  {key: "verified", label: "verified", get: (p) => recordRank(p.record),
   title: "what this machine's clients verified of its computing: vouched (a trusted certificate's evidence), " +
          "sessions its audits matched, caught computing something else, or convicted by a trusted certifier"},
  {key: "state", label: "state", get: (p) => p.departing ? 1 : 0,
   title: "live, or departing (it announced it is leaving)"},
];
// caught first, then by how much is verified (a certificate counts as 4 sessions, as the client counts it)
const recordRank = (r) => !r ? 0 : (r.caught || r.convicted) ? -1 : r.verified_sessions + (r.vouched ? 4 : 0);
const recordText = (r) => !r ? "\u2013" : r.caught ? "caught" : r.convicted ? "convicted" :
  [r.vouched ? "vouched" : null, r.verified_sessions ? `${r.verified_sessions} ok` : null]
    .filter(Boolean).join(", ") || "\u2013";

function peerRow(p) {
  const L = p.load, none = "\u2013";
  return el("tr", {"data-peer-id": p.peer_id, "data-state": p.departing ? "departing" : "live",
                   class: p.departing ? "departing" : null, title: `${p.peer_id} (version ${p.version})`},
    el("td", {}, label(p), p.name ? el("span", {class: "digest"}, " " + p.short_id) : null),
    el("td", {class: "mono"}, layers(p)),
    el("td", {title: p.reachability}, reach(p.reachability)),
    el("td", {class: "num"}, L ? fmt(L.tokens_per_s) : none),
    el("td", {class: "num"}, fmt(p.throughput_reported)),
    el("td", {class: "num"}, L ? pct(L.busy) : none),
    el("td", {class: "num"}, L ? fmt(L.rows_per_pass, 2) : none),
    el("td", {class: "num"}, L ? L.sessions : none),
    el("td", {class: "num"}, p.free_sessions),
    el("td", {class: "num"}, p.kv_tokens_free),
    el("td", {class: p.record && p.record.caught ? "leaving" : null,
              title: p.record && p.record.caught ? p.record.caught : null}, recordText(p.record)),
    el("td", {class: p.departing ? "leaving" : null}, p.departing ? "departing" : "live"));
}

function fillTable(card) {
  const ui = state.ui[card.id], peers = card.peers || [];
  const col = COLUMNS.find((c) => c.key === ui.sort) || COLUMNS[1];
  const rows = peers.filter((p) => !ui.filter || [p.name, p.peer_id, p.reachability, layers(p)]
    .some((s) => String(s).toLowerCase().includes(ui.filter)));
  rows.sort((a, b) => {
    const x = col.get(a), y = col.get(b);
    return ((x < y ? -1 : x > y ? 1 : 0) * ui.dir) || (a.peer_id < b.peer_id ? -1 : 1);
  });
  card.querySelector("tbody").replaceChildren(...rows.map(peerRow));
  const omitted = card.omitted ? ` (and ${card.omitted} more not listed: the bar counts them)` : "";
  card.querySelector(".shown").textContent = `${rows.length} of ${peers.length} peers${omitted}`;
  for (const th of card.querySelectorAll("table.peers th")) {
    th.dataset.dir = th.dataset.key === ui.sort ? String(ui.dir) : "";
  }
}

function makeCard(id, m, r) {
  const ui = state.ui[id] = state.ui[id] || {sort: "layers", dir: 1, filter: ""};
  const input = el("input", {type: "search", placeholder: "filter: name, peer ID, relay, layers",
                             "aria-label": "filter peers"});
  const head = el("tr", {}, COLUMNS.map((c) => el("th", {"data-key": c.key, title: c.title || null,
                                                        class: c.num ? "num" : null}, c.label)));
  const bar = `coverage-${m.model_digest}-${r.recipe_digest}`;  // full digests: a prefix costs nothing to copy
  const card = el("article", {class: "recipe", id, "data-model": m.model_digest, "data-recipe": r.recipe_digest},
    el("div", {class: "rhead"}),
    el("div", {class: "bar", role: "img", id: bar}),
    el("div", {class: "axis"}),
    el("div", {class: "lanes"}),
    el("div", {class: "tablebar"}, input, el("span", {class: "note shown"})),
    el("div", {class: "tablewrap"}, el("table", {class: "peers"}, el("thead", {}, head), el("tbody"))));
  input.value = ui.filter;
  input.addEventListener("input", () => { ui.filter = input.value.trim().toLowerCase(); fillTable(card); });
  head.addEventListener("click", (ev) => {
    const key = ev.target.dataset && ev.target.dataset.key;
    if (!key) return;
    ui.dir = ui.sort === key ? -ui.dir : 1; ui.sort = key; fillTable(card);
  });
  return card;
}

function drawBar(card, m, r) {
  const bar = card.querySelector(".bar"), n = m.n_layer, cells = [];
  let uncovered = 0;
  for (const [a, b, k] of r.layer_counts) {
    if (k === 0) uncovered += b - a;
    const cls = "cell c" + Math.min(k, 4), what = `${k} live peer${k === 1 ? "" : "s"}`;
    if (n <= CELLS_UP_TO) {
      for (let i = a; i < b; i++) {
        cells.push(el("div", {class: cls, "data-layer": i, "data-count": k, title: `layer ${i}: ${what}`},
                      n <= LABEL_CELLS_UP_TO ? String(k) : null));
      }
    } else {
      const c = el("div", {class: cls, "data-layers": `${a}-${b - 1}`, "data-count": k,
                           title: `layers ${a}-${b - 1}: ${what}`});
      c.style.flexGrow = String(b - a);  // CSSOM, which the page's CSP allows (a style attribute it would not)
      cells.push(c);
    }
  }
  bar.replaceChildren(...cells);
  bar.dataset.holes = String(uncovered);
  bar.dataset.uncovered = ranges(r.coverage.holes);
  bar.setAttribute("aria-label", uncovered ? `layers ${ranges(r.coverage.holes)} uncovered` : "every layer covered");
  const step = Math.max(1, Math.ceil(n / 10)), ticks = [];
  for (let i = 0; i < n; i += step) ticks.push(i);
  if (ticks[ticks.length - 1] !== n - 1 && (n - 1) - ticks[ticks.length - 1] >= step / 2) ticks.push(n - 1);
  card.querySelector(".axis").replaceChildren(...ticks.map((i) => {
    const t = el("span", {}, String(i));
    t.style.left = `${100 * (i + 0.5) / n}%`;
    return t;
  }));
}

function drawLanes(card, m, r) {
  const n = m.n_layer, lanes = [];
  let hidden = 0;
  const spans = [...r.peers].sort((a, b) => a.layers[0] - b.layers[0] || b.layers[1] - a.layers[1]);
  for (const p of spans) {  // first fit: each lane holds spans that do not overlap
    if (!(Math.min(n, p.layers[1]) > Math.max(0, p.layers[0]))) continue;  // nothing of it on this model's layers
    let lane = lanes.find((l) => l.end <= p.layers[0]);
    if (!lane) {
      if (lanes.length >= MAX_LANES) { hidden++; continue; }
      lanes.push(lane = {end: 0, items: []});
    }
    lane.end = p.layers[1]; lane.items.push(p);
  }
  const rows = lanes.map((l) => el("div", {class: "lane"}, l.items.map((p) => {
    const a = Math.min(n, Math.max(0, p.layers[0])), b = Math.min(n, Math.max(a, p.layers[1]));
    const cls = "span" + (p.departing ? " departing" : "") + (p.reachability !== "direct" ? " relayed" : "");
    const what = `${label(p)} ${p.peer_id}: layers ${layers(p)}, ${p.reachability}${p.departing ? ", departing" : ""}`;
    const s = el("div", {class: cls, "data-span-peer": p.peer_id, title: what}, label(p));
    s.style.left = `${100 * a / n}%`;
    s.style.width = `${100 * Math.max(0, b - a) / n}%`;
    return s;
  })));
  if (hidden) {
    rows.push(el("div", {class: "note"}, `${hidden} more of ${r.peers.length} peers not drawn: the bar above counts ` +
                                          "every live peer per layer, the table below lists them all"));
  }
  card.querySelector(".lanes").replaceChildren(...rows);
}

function updateCard(card, m, r) {
  const live = r.peers.filter((p) => !p.departing).length, leaving = r.peers.length - live;
  const labels = Object.values(r.labels || {}).join("/");
  const holes = r.coverage.holes;
  card.querySelector(".rhead").replaceChildren(...[
    el("strong", {}, "recipe"),
    el("span", {class: "digest", title: r.recipe_digest}, r.recipe_digest.slice(0, 12)),
    labels ? el("span", {}, labels) : null,
    r.state === "certified"
      ? el("span", {class: "state certified", "data-state": "certified", "data-certifier": r.certified_by,
                    title: `certifier ${r.certified_by}, ${r.method}`},
           `certified by ${short(r.certified_by)} (${r.method})`)
      : el("span", {class: "state dark", "data-state": "dark", title: "no certificate from a certifier this " +
                    "monitor trusts: clients that trust the same do not route users over it"}, "dark"),
    el("span", {}, `${live} live` + (leaving ? `, ${leaving} departing` : "")),
    holes.length ? el("span", {class: "holes"}, `uncovered layers ${ranges(holes)}`)
                 : el("span", {class: "covered"}, "every layer covered"),
    r.refused_evidence.length ? el("span", {class: "note", title: r.refused_evidence.join("\n")},
                                   `${r.refused_evidence.length} evidence refused`) : null].filter((x) => x !== null));
  drawBar(card, m, r);
  drawLanes(card, m, r);
  card.peers = r.peers;
  card.omitted = r.peers_omitted || 0;
  fillTable(card);
}

function renderModels(doc) {
  const root = $("#models");
  if (!doc.models.length) {
    const why = doc.survey.ok === null ? "waiting for the first survey\u2026" : "no model found in the swarm";
    root.replaceChildren(el("p", {id: "empty", class: "note"}, why));
    return;
  }
  doc.models.forEach((m, i) => {
    const id = "model-" + m.model_digest;
    const sec = document.getElementById(id) ||
                el("section", {class: "model", id, "data-model": m.model_digest}, el("h2"));
    const recipes = `${m.recipes.length} recipe${m.recipes.length === 1 ? "" : "s"}`;
    place(root, sec, i);
    sec.firstElementChild.replaceChildren(m.name || "unnamed model", " ",
      el("small", {}, `${m.model_digest.slice(0, 16)} \u00b7 ${m.n_layer} layers \u00b7 ${recipes}`));
    if (!m.recipes.length) {
      sec.replaceChildren(sec.firstElementChild, el("p", {class: "note"}, "no peer serves it"));
      return;
    }
    m.recipes.forEach((r, j) => {
      const cid = `recipe-${m.model_digest}-${r.recipe_digest}`;
      const card = document.getElementById(cid) || makeCard(cid, m, r);
      place(sec, card, j + 1);
      updateCard(card, m, r);
    });
    while (sec.children.length > m.recipes.length + 1) sec.lastElementChild.remove();
  });
  while (root.children.length > doc.models.length) root.lastElementChild.remove();
}

function renderRelays(relays) {
  if (!relays.length) { $("#relays").replaceChildren(el("p", {class: "note"}, "no relay announced")); return; }
  $("#relays").replaceChildren(...relays.map((r) => el("div", {class: "relay", "data-relay-id": r.peer_id,
                                                               title: r.addr},
    el("div", {}, el("span", {class: "mono"}, short(r.peer_id)), " ", el("small", {}, hostPort(r.addr))),
    el("div", {class: "note"}, `${r.load.reservations_now}/${r.limits.max_reservations} peers reserved \u00b7 ` +
       `${r.load.circuits_now} circuits now \u00b7 ${bytes(r.load.bytes)} carried \u00b7 ${r.load.refused} refused`))));
}

function renderEvents(events) {
  if (!events.length) { $("#events").replaceChildren(el("li", {class: "note"}, "nothing yet")); return; }
  $("#events").replaceChildren(...events.map((e) => {
    const at = new Date(e.at_ms);
    return el("li", {"data-kind": e.kind, "data-subject": e.peer_id},
      el("time", {datetime: at.toISOString()}, at.toLocaleTimeString([], {hour12: false})),
      el("span", {class: "kind kind-" + e.kind}, e.kind.replace(/^peer-/, "")), e.text);
  }));
}

function render(doc) {
  const t = doc.totals;
  const n = (k, noun) => `${k} ${noun}${k === 1 ? "" : "s"}`;
  $("#totals").textContent = [n(t.models, "model"), n(t.recipes, "recipe"), n(t.live, "live peer"),
                              t.departing ? `${t.departing} departing` : null, n(t.relays, "relay")]
    .filter((x) => x !== null).join(" \u00b7 ");
  renderModels(doc);
  renderRelays(doc.relays);
  renderEvents(doc.events);
  $("#certifiers").replaceChildren(...(doc.trusted_certifiers.length ? doc.trusted_certifiers.map((c) =>
    el("div", {class: "mono", title: c}, "\u2026" + c.slice(-16))) : [el("p", {class: "note"}, "none")]));
  document.body.dataset.updates = String(state.updates);
}

function freshness() {
  const doc = state.doc, pill = $("#freshness"), problem = $("#problem");
  let text, st, why = null;
  const age = doc && doc.survey.last_ok_ms !== null
    ? (doc.now_ms - doc.survey.last_ok_ms) + (Date.now() - state.fetchedAt) : null;  // both differences: no clock skew
  if (state.fetchError) {
    st = "error"; why = `cannot fetch api/swarm: ${state.fetchError}`;
    text = age === null ? "monitor unreachable" : `monitor unreachable: showing data from ${ago(age)} ago`;
  } else if (!doc || doc.survey.ok === null) {
    st = "waiting"; text = "waiting for the first survey";
  } else if (doc.survey.ok === false) {
    st = "stale"; why = `the monitor cannot survey the swarm: ${doc.survey.error}`;
    text = age === null ? "survey failing" : `survey failing: data from ${ago(age)} ago`;
  } else {
    st = "ok"; text = `updated ${ago(age)} ago`;
  }
  pill.textContent = text;
  pill.dataset.state = st;
  problem.hidden = !why;
  problem.textContent = why || "";
  document.body.classList.toggle("stale", st === "error" || st === "stale");
}

async function tick() {
  const ctl = new AbortController(), timer = setTimeout(() => ctl.abort(), FETCH_TIMEOUT_MS);
  try {
    const r = await fetch("api/swarm", {cache: "no-store", signal: ctl.signal});
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    const doc = await r.json();
    const fresh = !state.doc || doc.generated_at_ms !== state.doc.generated_at_ms || doc.events.length !==
                  state.doc.events.length || doc.survey.ok !== state.doc.survey.ok;
    state.doc = doc; state.fetchedAt = Date.now(); state.fetchError = null; state.updates++;
    if (fresh) render(doc);  // the same survey again: nothing to redraw (the freshness pill still moves)
    else document.body.dataset.updates = String(state.updates);
  } catch (e) {
    state.fetchError = e && e.name === "AbortError" ? `no answer in ${FETCH_TIMEOUT_MS / 1000} s`
                                                    : String((e && e.message) || e);
  } finally {
    clearTimeout(timer);
  }
  freshness();
  const every = state.doc ? Math.min(5, Math.max(0.5, state.doc.survey.interval_s)) : 2;
  setTimeout(tick, every * 1000);  // after the answer, so a slow server never has two requests waiting
}

setInterval(freshness, 1000);
tick();
"""

PAGE = f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>meshnet monitor</title>
<link rel="icon" href="data:,">
<style>{STYLE}</style>
</head>
<body data-updates="0">
<header>
<h1>meshnet monitor</h1>
<span id="totals"></span>
<span id="freshness" class="pill" data-state="waiting">waiting for the first update</span>
</header>
<div id="problem" role="alert" hidden></div>
<main>
<div id="models"><p id="empty" class="note">waiting for the first survey&hellip;</p></div>
<aside>
<div class="box"><h2>Relays</h2><div id="relays"><p class="note">&ndash;</p></div></div>
<div class="box"><h2>Recent events <small>newest first, as this monitor saw them</small></h2><ol id="events"></ol></div>
<div class="box"><h2>Trusted certifiers <small>whose certificates count here</small></h2>
<div id="certifiers"></div></div>
</aside>
</main>
<script>{SCRIPT}</script>
</body>
</html>
"""
