// rv ui: the page. Plain JavaScript, no build step; charts by uPlot (vendored, see VENDORED.md).
//
// One page, four views by the URL's hash: #/ (runs of every profile), #/run/P/ID, #/sweep/P/NAME and
// #/metrics/P/ID. Each view asks the server only for what it shows, and keeps asking (every few
// seconds) only while what it shows can still change: a run that ended is asked once. Leaving a view
// stops its polling; a hidden tab polls nothing.
"use strict";

const rvui = (window.rvui = { charts: {}, timers: [], view: null });
const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
  "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd"];

// --- small helpers ----------------------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "text") node.textContent = value;
    else if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

// Replace a node's children; null, undefined and false stand for nothing (DOM's own would print "null").
function fill(node, ...children) {
  node.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined && c !== false));
  return node;
}

async function api(path, params) {
  const query = new URLSearchParams();
  for (const [k, v] of Object.entries(params || {})) if (v !== null && v !== undefined) query.set(k, v);
  const response = await fetch(`/api/${path}?${query}`, { credentials: "same-origin" });
  return answer(response);
}

async function post(path, body) {
  const response = await fetch(`/api/${path}`, {
    method: "POST", credentials: "same-origin", headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
  });
  return answer(response);
}

async function answer(response) {
  const body = await response.json().catch(() => ({ error: `HTTP ${response.status}` }));
  if (!response.ok) {
    const error = new Error(body.error || `HTTP ${response.status}`);
    error.hint = body.hint;
    throw error;
  }
  return body;
}

function elapsed(seconds) {  // rv ps's way: [D-]H:MM:SS
  if (seconds === null || seconds === undefined) return "-";
  let s = Math.floor(seconds);
  const d = Math.floor(s / 86400); s %= 86400;
  const h = Math.floor(s / 3600); s %= 3600;
  const m = Math.floor(s / 60); s %= 60;
  return (d ? `${d}-` : "") + `${h}:${String(m).padStart(2, "0")}:${String(s).padStart(2, "0")}`;
}

function when(epoch) {
  return epoch ? new Date(epoch * 1000).toLocaleString() : "-";
}

function value(v) {  // four significant digits, integers as they are
  if (v === null || v === undefined) return "-";
  if (Number.isInteger(v) && Math.abs(v) < 1e6) return String(v);
  return Number(v).toPrecision(4).replace(/\.?0+(e|$)/, "$1");
}

function stateBadge(state) {
  return el("span", { class: `state state-${String(state || "unknown").toLowerCase()}`, text: state || "?" });
}

function link(text, hash) {
  return el("a", { href: hash, text });
}

function runHash(profile, id) { return `#/run/${encodeURIComponent(profile)}/${encodeURIComponent(id)}`; }
function sweepHash(profile, name) { return `#/sweep/${encodeURIComponent(profile)}/${encodeURIComponent(name)}`; }
function metricsHash(profile, id) { return `#/metrics/${encodeURIComponent(profile)}/${encodeURIComponent(id)}`; }

function crumbs(...parts) {
  const nav = document.getElementById("crumbs");
  fill(nav, ...parts.flatMap((p, i) => (i ? [" / ", p] : [p])));
}

function problem(where, error) {
  fill(where, el("div", { class: "error" }, error.message, error.hint ? el("div", { class: "hint", text: `next: ${error.hint}` }) : null));
}

// Ask ``fn`` now and every ``ms`` while it returns true and the view is the same; none while hidden.
// Returns a kick: ask again now (after an action), and go on asking while ``fn`` says so.
function every(ms, fn) {
  const view = rvui.view;
  let timer = null, busy = false, wanted = false;
  const schedule = (delay) => { timer = setTimeout(tick, delay); rvui.timers.push(timer); };
  async function tick() {
    timer = null;
    if (rvui.view !== view) return;
    if (document.hidden) { schedule(ms); return; }
    busy = true;
    wanted = false;
    let again = true;
    try { again = await fn(); } catch (error) { console.error(error); }
    busy = false;
    if (rvui.view === view && (again !== false || wanted)) schedule(wanted ? 0 : ms);
  }
  tick();
  return () => {
    if (busy) { wanted = true; return; }
    if (timer) clearTimeout(timer);
    tick();
  };
}

function chart(name, container, opts, data) {
  if (rvui.charts[name]) rvui.charts[name].destroy();
  const width = Math.max(320, container.clientWidth - 8);
  const u = new uPlot({ width, height: 260, ...opts }, data, container);
  rvui.charts[name] = u;
  return u;
}

// An action: asked first, then sent; what it did is said in ``out``, and ``then`` (the view's kick) runs.
function confirmThen(question, action, out, then) {
  if (!window.confirm(question)) return;
  fill(out, el("span", { class: "muted", text: "sending…" }));
  action().then(
    (result) => { fill(out, el("span", { class: "done", text: result })); then(); },
    (error) => problem(out, error),
  );
}

// --- #/ : the runs of every profile -----------------------------------------------------------------

const RUN_COLUMNS = ["cluster", "name", "state", "seg", "gpus", "node", "elapsed", "why / expected start", "job"];

async function runsView(main) {
  crumbs("runs");
  const { profiles } = await api("profiles");
  const rows = {}, problems = {};
  const shown = new Set(profiles.map((p) => p.name));
  let ended = true, filter = "";
  const body = el("tbody", { id: "runs-body" });
  const notes = el("div", { id: "cluster-notes" });
  const chips = profiles.map((p) => el("label", { class: "chip", title: `${p.user ? p.user + "@" : ""}${p.host}: ${p.root || ""}` },
    el("input", { type: "checkbox", checked: true, "data-profile": p.name, onchange: (e) => {
      if (e.target.checked) shown.add(p.name); else shown.delete(p.name); render();
    } }), ` ${p.name}`));
  fill(main, 
    el("div", { class: "controls" }, el("span", { class: "muted", text: "clusters:" }), chips,
      el("label", { class: "chip" }, el("input", { type: "checkbox", checked: true, id: "show-ended",
        onchange: (e) => { ended = e.target.checked; render(); } }), " ended in the last 7 days"),
      el("input", { type: "search", placeholder: "filter by name", id: "runs-filter",
        oninput: (e) => { filter = e.target.value.toLowerCase(); render(); } })),
    notes,
    el("table", { class: "runs" }, el("thead", {}, el("tr", {}, RUN_COLUMNS.map((c) => el("th", { text: c })))), body),
  );

  function render() {
    const all = profiles.filter((p) => shown.has(p.name)).flatMap((p) => rows[p.name] || []);
    const visible = all.filter((r) => (ended || r.live) && (!filter || r.name.toLowerCase().includes(filter)));
    visible.sort((a, b) => (a.kind === "job") - (b.kind === "job") || (b.created || 0) - (a.created || 0));
    fill(body, ...visible.map(runRow));
    fill(notes, ...profiles.filter((p) => problems[p.name]).map((p) =>
      el("div", { class: "error", "data-profile": p.name }, `${p.name}: ${problems[p.name]}`)));
    document.getElementById("status").textContent =
      `${visible.length} row(s) · ${profiles.filter((p) => rows[p.name]).length}/${profiles.length} cluster(s) answered`;
  }

  for (const p of profiles) {
    every(5000, async () => {
      try {
        const got = await api("runs", { profile: p.name });
        rows[p.name] = got.rows;
        problems[p.name] = got.warnings.join("; ") || null;
      } catch (error) {
        problems[p.name] = error.message + (error.hint ? ` (next: ${error.hint})` : "");
      }
      render();
      return true;
    });
  }
}

function runRow(r) {
  const name = r.kind === "run" ? link(r.name, runHash(r.profile, r.run_id))
    : r.kind === "sweep" ? link(r.name, sweepHash(r.profile, r.sweep)) : r.name;
  const gpus = r.gpus ? `${r.gpus}${r.gpu_type ? "×" + r.gpu_type : ""}` : "-";
  let why = r.reason || "";
  if (r.kind !== "sweep" && r.state === "RUNNING") why = "";
  if (r.expected_start) why += `${why ? "; " : ""}expected start ${r.expected_start}`;
  return el("tr", { class: `row-${r.kind}`, "data-profile": r.profile, "data-kind": r.kind, "data-name": r.name },
    el("td", { class: "cluster", text: r.profile }), el("td", {}, name), el("td", {}, stateBadge(r.state)),
    el("td", { class: "num", text: r.segments }), el("td", { text: gpus }),
    el("td", { text: r.node_list.length ? r.node_list.join(",") : "-" }),
    el("td", { class: "num", text: elapsed(r.elapsed) }), el("td", { class: "why", text: why }),
    el("td", { text: r.job_id || "-" }));
}

// --- #/run/P/ID : a run's chain, provenance, checkpoints and live logs ------------------------------------

async function runView(main, profile, id) {
  crumbs(link("runs", "#/"), profile, el("span", { id: "crumb-run", text: id }));
  const head = el("div", { class: "title" }), actions = el("div", { class: "actions" }), said = el("div", { id: "action-result" });
  const timeline = el("div", { class: "timeline", id: "timeline" }), segments = el("div");
  const provenance = el("div"), checkpoints = el("div"), used = el("div", { id: "usage" });
  const gpuPlot = el("div", { class: "chart wide", id: "gpu-chart" });
  const logBox = el("pre", { id: "log", class: "log" }), partial = el("span", { class: "partial" });
  logBox.append(partial);
  const logControls = el("div", { class: "controls" });
  fill(main, head, actions, said,
    el("section", {}, el("h2", { text: "Segments" }), timeline, segments),
    el("section", {}, el("h2", { text: "What it used" }), used, gpuPlot),
    el("section", { class: "cols" }, el("div", {}, el("h2", { text: "Provenance" }), provenance),
      el("div", {}, el("h2", { text: "Checkpoints" }), checkpoints)),
    el("section", {}, el("h2", { text: "Logs" }), logControls, logBox));

  let run = null;
  const refresh = every(5000, async () => {
    try {
      run = await api("run", { profile, id });
    } catch (error) {
      problem(head, error);
      return true;
    }
    document.getElementById("crumb-run").textContent = run.name;
    fill(head, el("h1", {}, run.name, " ", stateBadge(run.view.state)),
      el("div", { class: "muted" }, `${profile} · run ${run.run_id}`, run.sweep ? [" · point ", run.sweep.index, " of sweep ",
        link(run.sweep.name, sweepHash(profile, run.sweep.name))] : null, " · ", link("metrics", metricsHash(profile, id))),
      run.view.reason ? el("div", { class: "why", text: run.view.reason }) : null);
    const going = run.ended === null;
    fill(actions, going ? el("button", { id: "stop-run", class: "danger", onclick: () => confirmThen(
      `Stop run ${run.name}? Its job is cancelled and the chain goes no further (as rv stop ${run.name}).`,
      async () => {
        const got = await post("stop", { profile, run_id: id });
        const row = got.stopped[0];
        return row ? `stopped run ${row.name}: ${row.cancelled.length ? "cancelled job " + row.cancelled.join(", ") : "nothing was queued or running"}${row.error ? " (" + row.error + ")" : ""}`
          : "nothing to stop";
      }, said, () => refresh()) }, "Stop run") : null);
    drawTimeline(timeline, run);
    fill(segments, segmentTable(run));
    drawUsage(used, gpuPlot, run.usage);
    fill(provenance, provenanceTable(run));
    fill(checkpoints, checkpointTable(run.checkpoints));
    if (!logs.started) logs.start(run);
    return going || !run.ended;
  });

  // Logs: new complete lines every 2 s from where the last answer ended, on into the next segment.
  const logs = {
    started: false, stream: "out", rank: "all", follow: true, from: null, cursor: null, lines: [], seen: new Set(),
    start(first) {
      this.started = true;
      const ranks = first.meta.labeled && first.meta.ranks ? first.meta.ranks : 0;
      const segs = first.segments.map((s) => s.index);
      fill(logControls, 
        el("label", {}, "stream ", el("select", { id: "log-stream", onchange: (e) => { this.stream = e.target.value; this.reset(); } },
          el("option", { value: "out", text: "stdout" }), el("option", { value: "err", text: "stderr" }))),
        ranks ? el("label", {}, " rank ", el("select", { id: "log-rank", onchange: (e) => { this.rank = e.target.value; this.redraw(); } },
          el("option", { value: "all", text: "all" }), [...Array(ranks).keys()].map((r) => el("option", { value: String(r), text: String(r) })))) : null,
        el("label", {}, " from segment ", el("select", { id: "log-from", onchange: (e) => { this.from = e.target.value; this.reset(); } },
          el("option", { value: "", text: "the current one" }), segs.map((k) => el("option", { value: String(k), text: String(k) })))),
        el("label", {}, el("input", { type: "checkbox", checked: true, id: "log-follow", onchange: (e) => { this.follow = e.target.checked; } }), " follow"));
      this.poll();
    },
    reset() {
      this.cursor = null; this.lines = []; this.seen = new Set(); this.redraw(); this.generation = (this.generation || 0) + 1; this.poll();
    },
    poll() {
      const generation = this.generation || 0;
      every(2000, async () => {
        if (generation !== (this.generation || 0)) return false;
        const got = await api("logs", { profile, id, stream: this.stream,
          cursor: this.cursor ? JSON.stringify(this.cursor) : null, from: this.cursor ? null : this.from || null });
        if (generation !== (this.generation || 0)) return false;
        this.cursor = got.cursor;
        let partials = [];
        for (const seg of got.segments) {
          if (!this.seen.has(seg.segment)) {
            this.seen.add(seg.segment);
            this.add({ separator: true, text: `── segment ${seg.segment}${run ? "/" + run.meta.max_segments : ""} · job ${seg.job_id || "?"} ──` });
          }
          for (const file of Object.values(seg.files)) {
            for (const line of file.text.split("\n").slice(0, -1)) this.add(parseLine(line));
            if (file.partial) partials.push(parseLine(file.partial));
          }
        }
        partial.textContent = partials.filter((l) => this.shows(l)).map((l) => this.text(l) + "\n").join("");
        if (this.follow) logBox.scrollTop = logBox.scrollHeight;
        const more = got.ended === null || got.segments.some((s) => Object.values(s.files).some((f) => f.text));
        return more;
      });
    },
    shows(line) { return line.separator || this.rank === "all" || String(line.rank) === this.rank; },
    text(line) { return this.rank === "all" || line.separator ? line.text : line.bare; },
    add(line) {
      this.lines.push(line);
      if (this.shows(line)) logBox.insertBefore(document.createTextNode(this.text(line) + "\n"), partial);
    },
    redraw() {
      fill(logBox, ...this.lines.filter((l) => this.shows(l)).map((l) => document.createTextNode(this.text(l) + "\n")), partial);
    },
  };
}

// What the run used (rv stats's figures): per segment, per GPU, advice, and the GPU utilization over time.
function drawUsage(box, plot, u) {
  if (!u) { fill(box); return; }
  const pct = (x) => (x === null || x === undefined ? "?" : `${Math.round(x * 100)}%`);
  const mem = (n) => (n === null || n === undefined ? "?" : bytes(n));
  const su = (x, why) => (x === null || x === undefined ? `? (${why || "no rate"})` : x.toFixed(1));
  fill(box, el("p", { id: "usage-summary", text: u.summary }),
    el("table", { class: "results", id: "usage-table" },
      el("thead", {}, el("tr", {}, ["segment", "wall", "GPUs", "CPU efficiency", "peak memory", "SUs"].map((h) => el("th", { text: h })))),
      el("tbody", {}, u.segments.map((s) => el("tr", {},
        el("td", { text: String(s.segment) }), el("td", { class: "num", text: elapsed(s.wall_seconds) }),
        el("td", { text: s.gpu_count ? `${s.gpu_count}× ${s.gpu_type}` : "CPU only" }),
        el("td", { class: "num", text: pct(s.cpu_efficiency) }), el("td", { class: "num", text: mem(s.peak_memory_bytes) }),
        el("td", { class: "num", text: su(s.su, s.su_why) }))))),
    u.gpus.length ? el("table", { class: "results", id: "usage-gpus" },
      el("thead", {}, el("tr", {}, ["node", "GPU", "util mean", "util max", "peak memory"].map((h) => el("th", { text: h })))),
      el("tbody", {}, u.gpus.map((g) => el("tr", {}, el("td", { text: g.node }), el("td", { text: `${g.index} ${g.name}` }),
        el("td", { class: "num", text: g.util_mean === null ? "?" : `${g.util_mean}%` }),
        el("td", { class: "num", text: g.util_max === null ? "?" : `${g.util_max}%` }),
        el("td", { class: "num", text: mem(g.memory_peak_bytes) }))))) : null,
    u.segments.flatMap((s) => s.missing).map((m) => el("div", { class: "muted", text: m })),
    u.advice.map((a) => el("div", { class: "why", text: `advice: ${a}` })));
  if (!u.curves.length) { fill(plot); return; }
  const tables = u.curves.map((c) => [c.points.map((p) => p[0]), c.points.map((p) => p[1])]);
  fill(plot);
  chart("gpu", plot, {
    title: "GPU utilization (%), mean over each node's GPUs",
    scales: { y: { range: [0, 100] } },
    series: [{ label: "time" }, ...u.curves.map((c, i) => ({ label: `segment ${c.segment} · ${c.node}`, stroke: PALETTE[i % PALETTE.length], width: 2, spanGaps: true }))],
  }, uPlot.join(tables));
}

// A log line as a terminal shows it: the last state of a line redrawn with \r; its rank from its label.
function parseLine(raw) {
  const pieces = raw.split("\r").filter((p) => p !== "" && !/^\[\d+\] $/.test(p));
  const text = pieces.length ? pieces[pieces.length - 1] : "";
  const m = /^\[(\d+)\] /.exec(text);
  return { text, rank: m ? Number(m[1]) : null, bare: m ? text.slice(m[0].length) : text };
}

function outcome(reason) {
  const r = reason || "";
  if (r.startsWith("finished")) return "ok";
  if (r.startsWith("gpu fault") || r.includes("gpu fault")) return "fault";
  if (r.startsWith("crashed") || r.startsWith("failed")) return "fail";
  if (r.startsWith("time limit") || r.startsWith("stopped") || r.startsWith("preempted") || r.startsWith("requeued")) return "continued";
  if (r.startsWith("cancelled")) return "cancelled";
  return "other";
}

function drawTimeline(box, run) {
  const segs = run.segments.filter((s) => s.start);
  if (!segs.length) { fill(box, el("span", { class: "muted", text: "no segment has started yet" })); return; }
  const t0 = Math.min(...segs.map((s) => s.start));
  const t1 = Math.max(...run.segments.map((s) => s.end || (s.start ? run.now : 0)), t0 + 1);
  fill(box, ...run.segments.map((s) => {
    const bar = el("div", { class: `bar bar-${s.end ? outcome(s.reason) : s.start ? "running" : "pending"}`,
      title: `segment ${s.index}: ${s.reason || s.state}`, "data-segment": s.index, text: String(s.index) });
    const start = s.start || run.now, end = s.end || run.now;
    bar.style.left = `${((start - t0) / (t1 - t0)) * 100}%`;
    bar.style.width = `${Math.max(1.5, ((end - start) / (t1 - t0)) * 100)}%`;
    return bar;
  }), el("div", { class: "axis" }, el("span", { text: when(t0) }), el("span", { text: when(t1) })));
}

function segmentTable(run) {
  const head = ["#", "job", "state", "start", "end", "ran", "node", "GPU", "why it ended", "checkpoint step"];
  return el("table", { class: "segments" }, el("thead", {}, el("tr", {}, head.map((h) => el("th", { text: h })))),
    el("tbody", {}, run.segments.map((s) => {
      const q = s.queue;
      const state = q ? q.state : s.state === "ended" ? outcome(s.reason) : s.state;
      let why = s.reason || "";
      if (q && q.state === "PENDING") why = `pending${q.reason ? " (" + q.reason + ")" : ""}${q.start ? ", expected start " + q.start : ""}`;
      const ran = s.start ? elapsed((s.end || run.now) - s.start) : "-";
      return el("tr", { "data-segment": s.index }, el("td", { text: s.index }), el("td", { text: s.job_id || "-" }),
        el("td", {}, stateBadge(state)), el("td", { text: when(s.start) }), el("td", { text: when(s.end) }),
        el("td", { class: "num", text: ran }), el("td", { text: (q && q.node_list.length ? q.node_list.join(",") : s.nodes) || "-" }),
        el("td", { text: s.gpu_type || "-" }), el("td", { class: `why why-${outcome(s.reason)}`, text: why }),
        el("td", { class: "num", text: s.checkpoint_step ?? "-" }));
    })));
}

function provenanceTable(run) {
  const m = run.meta, req = m.request || {};
  const source = m.commit ? `${m.branch || "?"}@${String(m.commit).slice(0, 12)}${m.dirty ? " (with uncommitted changes)" : ""}` : "-";
  const rows = [
    ["command", (m.command || []).join(" ")], ["project", m.project], ["snapshot", m.snapshot], ["source", source],
    ["submitted", `${when(m.created)} from ${m.submitted_from || "?"}`],
    ["asked for", `${m.gpus || 0} GPU(s)${m.gpu_type ? " " + m.gpu_type : ""}${m.gpu_types ? " (any of " + m.gpu_types.join(", ") + ")" : ""}, ${m.nodes || 1} node(s), ${req.time_seconds ? elapsed(req.time_seconds) + " per segment" : ""}${req.mem ? ", " + req.mem + " memory" : ""}`],
    ["segments", `at most ${m.max_segments}`], ["environment", m.env || "-"], ["metrics file", m.metrics || "-"],
    ["secrets", run.secrets || "none"],
  ];
  if (run.sweep) rows.splice(1, 0, ["sweep point", `${run.sweep.index}: ${Object.entries(run.sweep.params || {}).map(([k, v]) => `${k}=${v}`).join(" ")}`]);
  if (run.ended) rows.push(["ended", `${run.ended.reason} (exit code ${run.ended.exit_code})`]);
  return el("table", { class: "kv", id: "provenance" }, el("tbody", {}, rows.map(([k, v]) => el("tr", {}, el("th", { text: k }), el("td", { text: v ?? "-" })))));
}

function checkpointTable(listing) {
  if (!listing) return el("span", { class: "muted", text: "-" });
  if (!listing.exists) return el("span", { class: "muted", text: "no checkpoint folder yet" });
  if (!listing.files) return el("span", { class: "muted", text: "none yet (the folder is empty)" });
  if (!listing.steps.length) return el("span", { text: `${listing.files} file(s), ${bytes(listing.bytes)} (not rv_train's step_<N> layout)` });
  return el("table", { class: "segments" }, el("thead", {}, el("tr", {}, ["step", "size", "saved", "state"].map((h) => el("th", { text: h })))),
    el("tbody", {}, listing.steps.map((s) => el("tr", {}, el("td", { class: "num", text: s.step }), el("td", { class: "num", text: bytes(s.bytes) }),
      el("td", { text: when(s.mtime) }),
      el("td", { text: (s.complete ? "complete" : "incomplete") + (s.step === listing.resume_step ? " · a resume starts here" : "") })))));
}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${i ? n.toFixed(1) : n} ${units[i]}`;
}

// --- #/metrics/P/ID : every numeric metric against its step ----------------------------------------------

async function metricsView(main, profile, id) {
  crumbs(link("runs", "#/"), profile, link(id, runHash(profile, id)), "metrics");
  let log = false, last = null;
  const grid = el("div", { class: "charts", id: "metric-charts" }), notes = el("div");
  fill(main, el("div", { class: "controls" }, el("label", {}, el("input", { type: "checkbox", id: "metrics-log",
    onchange: (e) => { log = e.target.checked; if (last) draw(last, true); } }), " log scale")), notes, grid);

  function draw(got, fresh) {
    const names = Object.keys(got.metrics);
    if (!names.length) {
      fill(grid, el("p", { class: "muted", text: got.exists ? "no numeric metric yet" : `no metrics yet: ${got.path} does not exist (programs write JSON lines to $RV_METRICS)` }));
      return;
    }
    if (fresh || grid.querySelectorAll(".chart").length !== names.length) {
      fill(grid, ...names.map((n) => el("div", { class: "chart", "data-metric": n })));
      fresh = true;
    }
    names.forEach((n, i) => {
      const series = got.metrics[n].series;
      const data = [series.map((p) => p[0]), series.map((p) => (log && p[1] <= 0 ? null : p[1]))];
      const box = grid.querySelector(`.chart[data-metric="${CSS.escape(n)}"]`);
      if (!fresh && rvui.charts[`metric:${n}`]) { rvui.charts[`metric:${n}`].setData(data); return; }
      chart(`metric:${n}`, box, {
        title: `${n} · last ${value(got.metrics[n].last)}`,
        scales: { x: { time: false }, y: { distr: log ? 3 : 1 } },
        series: [{ label: got.x }, { label: n, stroke: PALETTE[i % PALETTE.length], width: 2, spanGaps: true }],
        axes: [{ label: got.x }, {}],
      }, data);
    });
  }

  every(5000, async () => {
    try {
      last = await api("metrics", { profile, id });
    } catch (error) {
      problem(notes, error);
      return true;
    }
    crumbs(link("runs", "#/"), profile, link(last.name, runHash(profile, id)), "metrics");
    fill(notes, ...last.notes.map((n) => el("div", { class: "muted", text: n })));
    draw(last, false);
    document.getElementById("status").textContent = last.ended ? `run ended: ${last.ended.reason}` : "live: redrawn every 5 s";
    return last.ended === null;
  });
}

// --- #/sweep/P/NAME : the results table and every point's curve ---------------------------------------------

async function sweepView(main, profile, name) {
  crumbs(link("runs", "#/"), profile, `sweep ${name}`);
  let metric = null, log = false, sort = { key: "index", dir: 1 }, last = null;
  const head = el("div", { class: "title" }), actions = el("div", { class: "actions" }), said = el("div", { id: "action-result" });
  const picker = el("select", { id: "sweep-metric", onchange: (e) => { metric = e.target.value; drawChart(); } });
  const plot = el("div", { class: "chart wide", id: "sweep-chart" }), table = el("div"), notes = el("div");
  fill(main, head, actions, said, notes,
    el("div", { class: "controls" }, el("label", {}, "metric ", picker),
      el("label", {}, el("input", { type: "checkbox", id: "sweep-log", onchange: (e) => { log = e.target.checked; drawChart(); } }), " log scale")),
    plot, table);

  function drawChart() {
    if (!last || !metric) {
      fill(plot, el("p", { class: "muted", text: "no point has written a metric yet" }));
      return;
    }
    const points = last.points.filter((p) => p.series[metric] && p.series[metric].length);
    if (!points.length) { fill(plot, el("p", { class: "muted", text: `no point has written ${metric} yet` })); return; }
    const tables = points.map((p) => [p.series[metric].map((q) => q[0]), p.series[metric].map((q) => (log && q[1] <= 0 ? null : q[1]))]);
    const data = uPlot.join(tables);
    fill(plot, );
    chart("sweep", plot, {
      title: `${metric} by step, one curve per point`,
      scales: { x: { time: false }, y: { distr: log ? 3 : 1 } },
      series: [{ label: "step" }, ...points.map((p, i) => ({
        label: `${p.index}: ${Object.entries(p.params).map(([k, v]) => `${k}=${v}`).join(" ")}`,
        stroke: PALETTE[p.index % PALETTE.length], width: p.failed ? 1 : 2, dash: p.failed ? [4, 4] : undefined, spanGaps: true,
      }))],
    }, data);
  }

  function drawTable() {
    const cols = [["index", "point"], ...last.params.map((p) => [`param:${p}`, p]), ["state", "state"], ["segments", "seg"],
      ["wall_seconds", "wall"], ["su", "SU"], ...last.metrics.map((m) => [`metric:${m}`, m])];
    const key = (p, k) => k.startsWith("param:") ? p.params[k.slice(6)] : k.startsWith("metric:") ? p.metrics[k.slice(7)] : p[k];
    const rows = [...last.points].sort((a, b) => {
      const x = key(a, sort.key), y = key(b, sort.key);
      if (x === undefined || x === null) return 1;
      if (y === undefined || y === null) return -1;
      const nx = Number(x), ny = Number(y);
      const c = !Number.isNaN(nx) && !Number.isNaN(ny) ? nx - ny : String(x).localeCompare(String(y));
      return c * sort.dir || a.index - b.index;
    });
    fill(table, el("table", { class: "results", id: "sweep-table" },
      el("thead", {}, el("tr", {}, el("th", {}), cols.map(([k, label]) => el("th", { class: "sortable" + (sort.key === k ? (sort.dir > 0 ? " asc" : " desc") : ""),
        "data-key": k, text: label, onclick: () => { sort = { key: k, dir: sort.key === k ? -sort.dir : 1 }; drawTable(); } })))),
      el("tbody", {}, rows.map((p) => el("tr", { class: p.failed ? "failed" : "", "data-index": p.index },
        el("td", { class: "mark", text: p.failed ? "✗" : "" }),
        el("td", {}, p.run_id ? link(String(p.index), runHash(profile, p.run_id)) : String(p.index)),
        last.params.map((k) => el("td", { text: p.params[k] ?? "" })), el("td", {}, stateBadge(p.state)),
        el("td", { class: "num", text: p.segments }), el("td", { class: "num", text: elapsed(p.wall_seconds) }),
        el("td", { class: "num su", text: p.su === null || p.su === undefined ? "?" : p.su.toFixed(1) }),
        last.metrics.map((m) => el("td", { class: "num", text: value(p.metrics[m]) }))))),
      el("tfoot", {}, el("tr", { id: "sweep-su-total" }, el("td", {}), el("td", { text: "total" }),
        last.params.map(() => el("td", {})), el("td", {}), el("td", {}), el("td", {}),
        el("td", { class: "num", text: last.su_total === null ? "?" : last.su_total.toFixed(1) }),
        last.metrics.map(() => el("td", {}))))));
  }

  const refresh = every(5000, async () => {
    try {
      last = await api("sweep", { profile, name });
    } catch (error) {
      problem(head, error);
      return true;
    }
    const counts = {};
    for (const p of last.points) counts[p.state] = (counts[p.state] || 0) + 1;
    fill(head, el("h1", { text: `sweep ${name}` }), el("div", { class: "muted", id: "sweep-counts",
      text: `${profile} · ${last.points.length} point(s): ${Object.entries(counts).map(([s, n]) => `${n} ${s.toLowerCase()}`).join(", ")}` }));
    fill(notes, ...last.warnings.map((w) => el("div", { class: "muted", text: w })));
    const live = last.points.some((p) => p.live);
    fill(actions, 
      live ? el("button", { id: "stop-sweep", class: "danger", onclick: () => confirmThen(
        `Stop sweep ${name}? Every point that has not ended is cancelled (as rv stop ${name}).`,
        async () => { const got = await post("stop", { profile, sweep: name }); return `stopped ${got.stopped.length} point(s) of sweep ${name}`; }, said, () => refresh()) }, "Stop sweep") : null,
      last.retryable.length && !live ? el("button", { id: "retry-sweep", onclick: () => confirmThen(
        `Retry points ${last.retryable.join(", ")} of sweep ${name}? Each runs again as a new run of its name (as rv sweep retry ${name}).`,
        async () => { const got = await post("retry", { profile, sweep: name }); return [got.message, ...got.arrays.map((a) => `job array ${a}`), ...got.notes].join(" · "); }, said, () => refresh()) },
        `Retry ${last.retryable.length} failed point(s)`) : null);
    const names = last.metrics;
    if (!metric || !names.includes(metric)) metric = names.find((n) => /loss/.test(n)) || names[0] || null;
    fill(picker, ...names.map((n) => el("option", { value: n, text: n, selected: n === metric })));
    drawChart();
    drawTable();
    return live;
  });
}

// --- the router ---------------------------------------------------------------------------------

function route() {
  rvui.timers.forEach(clearTimeout);
  rvui.timers = [];
  for (const u of Object.values(rvui.charts)) u.destroy();
  rvui.charts = {};
  const view = (rvui.view = {});
  const main = document.getElementById("main");
  document.getElementById("status").textContent = "";
  const [kind, profile, key] = location.hash.replace(/^#\/?/, "").split("/").map(decodeURIComponent);
  const views = { run: runView, sweep: sweepView, metrics: metricsView };
  const shown = (views[kind] || runsView)(main, profile, key);
  shown.catch((error) => { if (rvui.view === view) problem(main, error); });
}

window.addEventListener("hashchange", route);
route();
