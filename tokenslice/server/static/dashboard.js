// The live view: draws one scheduler snapshot (GET /v1/state's JSON) at a time.
// Live mode reads /v1/state/stream (server-sent events, read with fetch so that the API key can
// travel as a Bearer header); replay mode (tokenslice view) reads a recording from /v1/replay.
"use strict";

const KEY_STORE = "tokenslice-api-key";
const CROWDED = 200; // more chips than this in a lane: show counts by state instead
const STATES = ["running", "waiting", "preempted", "swapping", "on host", "to recompute"];
const SVG = "http" + "://www.w3.org/2000/svg"; // the SVG namespace (an identifier, never fetched)
const $ = (id) => document.getElementById(id);
const cls = (state) => "state-" + state.replace(/ /g, "-");

function setStatus(text) { $("status").textContent = text; }

// ---- lanes: the policy's queues in its own terms (Policy.describe_queues) ----------------------
function ids(list) { return list.map((x) => (typeof x === "string" ? x : x.id)); }

// Each lane has a key that stays the same across snapshots (its label may not: a VTC counter).
function lanesOf(queues) {
  switch (queues.kind) {
    case "mlfq": return queues.queues.map((q) => ({ key: `q${q.level}`, name: `Q${q.level} · quantum ${q.quantum_s.toPrecision(3)} s`, ids: ids(q.requests) }));
    case "priority": return queues.classes.map((c) => ({ key: `p${c.priority}`, name: `priority ${c.priority}`, ids: ids(c.requests) }));
    case "vtc": return queues.users.map((u) => ({ key: `u${u.tenant}/${u.user}`, name: `${u.tenant ? "tenant " + u.tenant + " · " : ""}user ${u.user} · counter ${Math.round(u.counter)}`, ids: ids(u.requests) }));
    case "request-level": return [{ key: "batch", name: "batch", ids: ids(queues.batch) }, { key: "order", name: "waiting for the batch", ids: ids(queues.order) }];
    case "srpt": return [{ key: "order", name: "by predicted remaining time", ids: ids(queues.order) }];
    case "sorted": return [{ key: "order", name: `by ${queues.key.replace(/_/g, " ")}`, ids: ids(queues.order) }];
    case "fifo": return [{ key: "order", name: "arrival order", ids: ids(queues.order) }];
    default: return [];
  }
}

// One element per lane and per request, kept across snapshots (keyed by lane key and request
// id), so that a chip is the same node from one refresh to the next and can be seen to move.
const board = { lanes: new Map(), chips: new Map(), empty: null };
const MOVE_MS = 300; // a chip's glide to its new lane
const MAX_MOVERS = 150; // more chips than this changing lane at once: jump, do not glide
const PAUSED = ["preempted", "swapping", "on host", "to recompute"]; // states a preemption or a swap leads to
const motion = () => !window.matchMedia("(prefers-reduced-motion: reduce)").matches;

function chipTitle(r) {
  return `${r.id}${r.user ? " · " + r.user : ""} · ${r.state} · ${r.output_tokens} tokens out` +
    (r.predicted_output_tokens != null ? ` (predicted ${r.predicted_output_tokens})` : "") +
    ` · ${r.preemptions} preemptions · ${r.swaps} swaps` +
    (r.slack_s != null ? ` · slack ${r.slack_s.toFixed(2)} s${r.protected ? " (protected)" : ""}` : "") +
    (r.stall_s ? ` · reader waited ${r.stall_s.toFixed(2)} s` : "");
}

// The chip of `r`, made on first sight; a state change recolours it (a CSS transition) and a
// preemption or a swap makes it pulse once.
function chipFor(r) {
  let el = board.chips.get(r.id);
  if (!el) {
    el = document.createElement("span");
    el.dataset.id = r.id;
    board.chips.set(r.id, el);
  }
  const className = "chip " + cls(r.state);
  if (el.className !== className) {
    const was = el.dataset.state;
    el.className = className;
    el.dataset.state = r.state;
    if (was && PAUSED.includes(r.state) && motion())
      el.animate([{ boxShadow: "0 0 0 3px #1d2430" }, { boxShadow: "0 0 0 0 #1d2430" }], { duration: 600, easing: "ease-out" });
  }
  const title = chipTitle(r);
  if (el.title !== title) el.title = title;
  return el;
}

function crowd(reqs) {
  const el = document.createElement("span");
  el.className = "crowd";
  const n = {};
  for (const r of reqs) n[r.state] = (n[r.state] || 0) + 1;
  for (const s of STATES) {
    if (!n[s]) continue;
    const c = document.createElement("span");
    c.className = "chip " + cls(s);
    c.dataset.count = String(n[s]);
    c.textContent = `${n[s]} ${s}`;
    el.append(c, " ");
  }
  return el;
}

function laneRow(key) {
  let lane = board.lanes.get(key);
  if (!lane) {
    const row = document.createElement("div");
    row.className = "lane";
    row.dataset.lane = key;
    const name = document.createElement("div");
    name.className = "lane-name";
    const chips = document.createElement("div");
    chips.className = "lane-chips";
    row.append(name, chips);
    lane = { row, name, chips };
    board.lanes.set(key, lane);
  }
  return lane;
}

// Makes `parent`'s children exactly `want`, in order, moving only what is out of place.
function reconcile(parent, want) {
  for (let i = 0; i < want.length; i++) {
    if (parent.children[i] !== want[i]) parent.insertBefore(want[i], parent.children[i] || null);
  }
  while (parent.children.length > want.length) parent.lastElementChild.remove();
}

function drawLanes(snap) {
  const byId = new Map(snap.requests.map((r) => [r.id, r]));
  const lanes = lanesOf(snap.queues);
  const placed = new Set(lanes.flatMap((l) => l.ids));
  const rest = snap.requests.filter((r) => !placed.has(r.id)).map((r) => r.id);
  if (rest.length) lanes.push({ key: "rest", name: lanes.length ? "elsewhere" : "live requests", ids: rest });
  // FLIP (first, last, invert, play): where each shown chip was, before this snapshot moves it.
  const animate = motion();
  const laneOf = new Map(), first = new Map();
  for (const [key, lane] of board.lanes) for (const el of lane.chips.children) if (el.dataset.id) laneOf.set(el.dataset.id, key);
  const movers = lanes.flatMap((l) => l.ids.length > CROWDED ? [] : l.ids.filter((id) => laneOf.has(id) && laneOf.get(id) !== l.key));
  if (animate && movers.length <= MAX_MOVERS) for (const id of movers) first.set(id, board.chips.get(id).getBoundingClientRect());
  // Empty lanes (an MLFQ has many levels) share one line, so busy ones stay on screen.
  const empty = lanes.filter((l) => !l.ids.length);
  const shown = lanes.filter((l) => l.ids.length || empty.length < 2);
  const rows = [];
  for (const l of shown) {
    const lane = laneRow(l.key);
    const label = `${l.name} (${l.ids.length})`;
    if (lane.name.textContent !== label) lane.name.textContent = label;
    const reqs = l.ids.map((id) => byId.get(id)).filter(Boolean);
    // A crowded lane shows counts by state: a thousand chips would say less, and cost more.
    reconcile(lane.chips, reqs.length > CROWDED ? [crowd(reqs)] : reqs.map(chipFor));
    rows.push(lane.row);
  }
  if (empty.length >= 2) {
    if (!board.empty) { board.empty = document.createElement("div"); board.empty.className = "lane lane-name"; }
    board.empty.textContent = `empty: ${empty.map((l) => l.name.split(" · ")[0]).join(", ")}`;
    rows.push(board.empty);
  }
  reconcile($("lanes"), rows);
  for (const key of board.lanes.keys()) if (!shown.some((l) => l.key === key)) board.lanes.delete(key);
  for (const id of board.chips.keys()) if (!byId.has(id)) board.chips.delete(id);
  // Play: each chip that changed lane starts where it was and glides to where it is now.
  for (const [id, was] of first) {
    const el = board.chips.get(id);
    if (!el || !el.isConnected) continue;
    const now = el.getBoundingClientRect();
    const dx = was.left - now.left, dy = was.top - now.top;
    if (dx || dy) el.animate([{ transform: `translate(${dx}px, ${dy}px)` }, { transform: "none" }], { duration: MOVE_MS, easing: "ease-out" });
  }
}

// ---- memory: block maps, one cell per block (or per group of blocks on a large pool) ----------
function drawMap(svg, total, runs) {
  const width = svg.clientWidth || 400, height = 120;
  const perCell = Math.max(1, Math.ceil(total / 2048));
  const cells = Math.ceil(total / perCell);
  const side = Math.max(2, Math.floor(Math.sqrt((width * height) / Math.max(1, cells))));
  const cols = Math.max(1, Math.floor(width / side));
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.replaceChildren();
  let cell = 0;
  for (const run of runs) {
    const n = Math.round(run.blocks / perCell);
    for (let i = 0; i < n && cell < cells; i++, cell++) {
      const rect = document.createElementNS(SVG, "rect");
      rect.setAttribute("x", (cell % cols) * side);
      rect.setAttribute("y", Math.floor(cell / cols) * side);
      rect.setAttribute("width", side - 1);
      rect.setAttribute("height", side - 1);
      rect.setAttribute("class", run.cls);
      if (run.title) {
        const t = document.createElementNS(SVG, "title");
        t.textContent = run.title;
        rect.append(t);
      }
      svg.append(rect);
    }
  }
}

function drawMemory(snap) {
  const kv = snap.kv, owners = kv.owners || {};
  const byId = new Map(snap.requests.map((r) => [r.id, r]));
  const runs = (tier) => Object.entries(owners).filter(([, o]) => o[tier] > 0)
    .map(([id, o]) => ({ blocks: o[tier], cls: cls(byId.get(id) ? byId.get(id).state : "waiting"), title: `${id}: ${o[tier]} blocks` }));
  const dev = runs("device");
  const owned = dev.reduce((a, r) => a + r.blocks, 0);
  // Used blocks no live request owns: the prefix cache's, or ones being released.
  if (kv.device.used > owned) dev.push({ blocks: kv.device.used - owned, cls: "cached", title: "cached or releasing" });
  if (kv.reserved_blocks) dev.push({ blocks: kv.reserved_blocks, cls: "reserved", title: "reserved for a burst (FastServe §4.2)" });
  drawMap($("device-map"), kv.device.blocks, dev);
  drawMap($("host-map"), kv.host.blocks, runs("host"));
  $("device-usage").textContent = `${kv.device.used} / ${kv.device.blocks} used · ${kv.transfers_in_flight} transfers in flight`;
  $("host-usage").textContent = `${kv.host.used} / ${kv.host.blocks} used`;
}

// ---- traffic and latency ---------------------------------------------------------------------
function sparkline(svg, series) {
  svg.replaceChildren();
  const max = Math.max(1e-9, ...series.flatMap((p) => p.slice(1)));
  const t0 = series.length ? series[0][0] : 0, span = Math.max(1e-9, -t0);
  for (const [k, colour] of [[1, "var(--on-host)"], [2, "var(--running)"]]) {
    const line = document.createElementNS(SVG, "polyline");
    line.setAttribute("points", series.map((p) => `${(300 * (p[0] - t0)) / span},${60 - (58 * p[k]) / max}`).join(" "));
    line.setAttribute("fill", "none");
    line.setAttribute("stroke", colour);
    line.setAttribute("vector-effect", "non-scaling-stroke");
    svg.append(line);
  }
}

function bytes(n) {
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function ms(s) { return s == null ? "–" : `${(s * 1000).toFixed(1)} ms`; }

function drawLatency(latency) {
  for (const name of ["ttft", "tbt"]) {
    const row = $("latency-" + name);
    const l = latency ? latency[name] : null;
    row.replaceChildren(row.firstElementChild);
    for (const v of l ? [ms(l.p50), ms(l.p90), ms(l.p99), l.count] : ["–", "–", "–", "–"]) {
      const td = document.createElement("td");
      td.textContent = v;
      row.append(td);
    }
  }
}

// ---- one snapshot ----------------------------------------------------------------------------
// `history` (a recording): [seconds before snap, host blocks used, transfers in flight] per snapshot.
function draw(snap, history) {
  const c = snap.counts || {};
  for (const r of snap.requests) if (!snap.counts) c[r.state] = (c[r.state] || 0) + 1;
  // Live: the engine's own gauges, as /metrics reports them; a recording: derived from the states.
  const e = snap.engine || { num_running: c.running || 0, num_waiting: (c.waiting || 0) + (c["to recompute"] || 0),
    num_preempted: c.preempted || 0, num_swapped: c["on host"] || 0 };
  $("count-running").textContent = e.num_running;
  $("count-waiting").textContent = e.num_waiting;
  $("count-preempted").textContent = e.num_preempted;
  $("count-swapped").textContent = e.num_swapped;
  $("count-swapping").textContent = c.swapping || 0;
  $("count-to-recompute").textContent = c["to recompute"] || 0;
  // Live: the engine's step number, which /metrics also reports (tokenslice:engine_steps_total).
  $("engine-step").parentElement.hidden = !snap.engine;
  if (snap.engine) $("engine-step").textContent = snap.engine.num_steps;
  $("scheduler").textContent = `${snap.policy} · ${snap.preemption} · ${snap.requests.length} live` +
    (snap.run ? ` · run ${JSON.stringify(snap.run)}` : "");
  drawLanes(snap);
  drawMemory(snap);
  if (snap.swap) {
    $("sparkline-title").textContent = "swap traffic (bytes/s: out blue, in green)";
    sparkline($("swap-sparkline"), snap.swap.series);
    $("swap-summary").textContent = `last ${snap.swap.window_s.toFixed(0)} s: out ${bytes(snap.swap.out_bytes)}, ` +
      `in ${bytes(snap.swap.in_bytes)}, ${snap.swap.ops} copy ops`;
  } else if (history) {
    $("sparkline-title").textContent = "host KV blocks used (blue) and transfers in flight (green)";
    sparkline($("swap-sparkline"), history);
    $("swap-summary").textContent = `t = ${snap.t.toFixed(2)} s (simulated)`;
  }
  drawLatency(snap.latency);
  $("view").hidden = false;
  // Which snapshot is on screen (a live server numbers them) and how many were drawn: lets a
  // test, or a curious user, tell a fresh view from a stale one.
  if (snap.seq != null) document.body.dataset.seq = String(snap.seq);
  document.body.dataset.drawn = String(Number(document.body.dataset.drawn || 0) + 1);
}

// ---- live mode ----------------------------------------------------------------------------------
function askForKey() {
  $("view").hidden = true;
  $("key-prompt").hidden = false;
  setStatus("API key needed");
}

// "pause" holds the picture still to look at it; the stream goes on and the latest snapshot is
// drawn on "resume".
const frozen = { on: false, latest: null };
$("pause").addEventListener("click", () => {
  frozen.on = !frozen.on;
  $("pause").textContent = frozen.on ? "resume" : "pause";
  if (frozen.on) setStatus("paused");
  else if (frozen.latest) { draw(frozen.latest); setStatus("live"); frozen.latest = null; }
});

async function live() {
  const key = sessionStorage.getItem(KEY_STORE);
  const headers = key ? { Authorization: "Bearer " + key } : {};
  let resp;
  try {
    resp = await fetch("/v1/state/stream", { headers });
  } catch (err) {
    setStatus("server unreachable; retrying");
    setTimeout(live, 2000);
    return;
  }
  if (resp.status === 401) { askForKey(); return; }
  if (!resp.ok) { setStatus(`error ${resp.status}; retrying`); setTimeout(live, 2000); return; }
  $("key-prompt").hidden = true;
  setStatus("live");
  const reader = resp.body.getReader(), decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
      if (!data) continue;
      if (event.startsWith("event: error")) { setStatus("engine error: " + JSON.parse(data).message); continue; }
      const snap = JSON.parse(data);
      if (frozen.on) { frozen.latest = snap; continue; }
      draw(snap);
      setStatus(`live · ${new Date(snap.time * 1000).toLocaleTimeString()} · ${snap.viewers} viewer(s)`);
    }
  }
  setStatus("stream ended; reconnecting");
  setTimeout(live, 2000);
}

$("key-prompt").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem(KEY_STORE, $("key-input").value);
  $("key-input").value = "";
  live();
});

// ---- replay mode ------------------------------------------------------------------------------
// A recording can be hundreds of MB: the page loads its index (runs, each snapshot's time and
// history numbers), then only the pages of snapshots the slider reaches, a few kept at a time.
const PAGE_BYTES = 4 << 20; // about this much JSON per page fetched
const KEPT_PAGES = 8;

function runLabel(labels) {
  const text = Object.entries(labels).map(([k, v]) => `${k}=${typeof v === "number" ? +v.toPrecision(4) : v}`).join(" ");
  return text || "run";
}

class Recording {
  constructor(index) { this.runs = index.runs; this.pages = new Map(); }

  pageSize(run) { return Math.max(1, Math.min(256, Math.floor((PAGE_BYTES * run.snapshots) / Math.max(1, run.bytes)))); }

  page(run, p) {
    const key = `${run.id}:${p}`;
    let got = this.pages.get(key);
    if (got) this.pages.delete(key); // most recently used last
    else {
      const size = this.pageSize(run);
      got = fetch(`/v1/replay?run=${run.id}&start=${p * size}&stop=${(p + 1) * size}`).then((r) => {
        if (!r.ok) throw new Error(`the recording's page ${p} of run ${run.id}: error ${r.status}`);
        return r.text();
      }).then((text) => text.split("\n").filter((l) => l.trim()).map((l) => JSON.parse(l)));
      got.catch(() => this.pages.delete(key)); // asked again next time
    }
    this.pages.set(key, got);
    while (this.pages.size > KEPT_PAGES) this.pages.delete(this.pages.keys().next().value);
    return got;
  }

  async snapshot(run, i) {
    const size = this.pageSize(run), p = Math.floor(i / size);
    const snaps = await this.page(run, p);
    if ((p + 1) * size < run.snapshots && i - p * size >= size / 2) this.page(run, p + 1); // playing on: fetch ahead
    return snaps[i - p * size];
  }
}

async function replay() {
  $("replay").hidden = false;
  $("pause").hidden = true; // the slider has its own play and pause
  setStatus("loading the recording's index…");
  const rec = new Recording(await (await fetch("/v1/replay/index")).json());
  const select = $("replay-run"), slider = $("replay-slider");
  for (const run of rec.runs) select.append(new Option(runLabel(run.labels), String(run.id)));
  let timer = null, latest = 0;
  const show = async () => {
    const run = rec.runs[Number(select.value)];
    const i = run ? Math.min(Number(slider.value), run.snapshots - 1) : -1;
    if (i < 0) return;
    const ticket = ++latest;
    let snap;
    try {
      snap = await rec.snapshot(run, i);
    } catch (err) {
      setStatus(String(err.message || err));
      return;
    }
    if (ticket !== latest) return; // the slider moved on while this page loaded
    const lo = Math.max(0, i - 120);
    draw(snap, run.t.slice(lo, i + 1).map((t, k) => [t - run.t[i], run.host_used[lo + k], run.in_flight[lo + k]]));
    $("replay-time").textContent = `${i + 1} / ${run.snapshots} · t = ${snap.t.toFixed(2)} s`;
  };
  select.addEventListener("change", () => {
    slider.max = String((rec.runs[Number(select.value)] || { snapshots: 0 }).snapshots - 1);
    slider.value = "0";
    show();
  });
  slider.addEventListener("input", show);
  $("replay-play").addEventListener("click", () => {
    if (timer) { clearInterval(timer); timer = null; $("replay-play").textContent = "play"; return; }
    $("replay-play").textContent = "pause";
    timer = setInterval(() => {
      if (Number(slider.value) >= Number(slider.max)) { clearInterval(timer); timer = null; $("replay-play").textContent = "play"; return; }
      slider.value = String(Number(slider.value) + 1);
      show();
    }, 250);
  });
  select.dispatchEvent(new Event("change"));
  setStatus(`replay · ${rec.runs.length} run(s)`);
}

if (document.body.dataset.mode === "replay") replay(); else live();
