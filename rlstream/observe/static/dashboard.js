// rlstream dashboard: metric events over server-sent events -> uPlot charts.
// window.rlstream exposes what arrived (events, points per chart, latest values) for tests.
(function () {
  "use strict";
  const CHARTS = [
    { name: "reward", title: "reward", keys: ["reward/mean"] },
    { name: "eval", title: "held-out eval (per round)", keys: [], match: /^eval\/(pass@\d+|[^/]+\/mean)$/ },
    { name: "kl", title: "KL", keys: ["policy/kl", "policy/approx_kl", "policy/mismatch_kl"] },
    { name: "loss", title: "loss", keys: ["loss/total", "loss/policy"] },
    { name: "throughput", title: "throughput (/s)", keys: ["producer/tokens_per_s", "producer/groups_per_s", "scorer/groups_per_s"] },
    { name: "staleness", title: "staleness (policy versions)", keys: ["buffer/staleness_mean", "buffer/staleness_max", "offpolicy/lag_mean"] },
    { name: "mismatch", title: "mismatch KL: train/inference (lag 0) vs stale", keys: ["offpolicy/mismatch_kl_fresh", "offpolicy/mismatch_kl_stale"] },
    { name: "importance", title: "importance weights", keys: ["is/ess", "is/ess_raw", "is/ess_beyond", "is/truncated_frac", "is/masked_frac"] },
    { name: "stale", title: "stale groups: dropped vs kept and corrected (running totals)", keys: ["buffer/dropped_stale", "buffer/kept_stale"] },
    { name: "buffer", title: "buffer depth (groups)", keys: ["buffer/depth"] },
  ];
  const MAX_POINTS = 20000;
  const COLOURS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777"];

  const params = new URLSearchParams(window.location.search);
  const state = { events: 0, lastSeq: 0, points: {}, latest: {}, connected: false, lengths: {}, lengthMeans: null,
                  x: params.get("x") === "step" ? "step" : "time", xs: {}, samples: { rows: [], matched: 0 }, stages: null };
  window.rlstream = state;

  const charts = CHARTS.map((def) => {
    const card = document.createElement("div");
    card.className = "card";
    card.innerHTML = `<h2>${def.title}</h2><div class="empty">no data yet</div>`;
    document.getElementById("charts").appendChild(card);
    state.points[def.name] = 0;
    return { def, card, plot: null, series: [], index: {}, data: [[]], rows: [], dirty: false };
  });

  // groups by mean completion length: the learner's running totals trained and dropped as too stale
  // (lengths/trained_le64, lengths/dropped_stale_le64, ...); long completions finish late, so a
  // staleness bound that drops starves them first; and the exact mean completion length of each side
  // (lengths/mean_dropped_stale vs lengths/mean_trained; 0 while a side has no groups: shown as "-")
  const LENGTH_KEY = /^lengths\/(trained|dropped_stale)_((?:le|gt)\d+)$/;
  let lengthsDirty = false;
  const lengthsCard = document.createElement("div");
  lengthsCard.className = "card";
  lengthsCard.id = "lengths";
  lengthsCard.innerHTML = "<h2>groups by mean completion length (tokens): trained vs dropped stale</h2><div class=\"empty\">no data yet</div>";
  document.getElementById("charts").appendChild(lengthsCard);
  function showLengths() {
    const order = (b) => parseInt(b.slice(2), 10) + (b.startsWith("gt") ? 0.5 : 0);
    const buckets = Object.keys(state.lengths).filter((b) => state.lengths[b].trained + state.lengths[b].dropped_stale > 0)
      .sort((a, b) => order(a) - order(b));
    if (!buckets.length) return;
    const means = state.lengthMeans || {};
    const mean = (k) => (means[k] > 0 ? String(Math.round(means[k])) : "-");
    const meansLine = state.lengthMeans
      ? `<div id="length-means" style="font-size:12px;margin:2px 4px">dropped as stale: mean ${mean("dropped_stale")} tokens vs ${mean("trained")} trained</div>`
      : "";
    const most = Math.max(...buckets.map((b) => state.lengths[b].trained + state.lengths[b].dropped_stale));
    const rows = buckets.map((b) => {
      const { trained, dropped_stale: dropped } = state.lengths[b];
      const share = dropped / (trained + dropped);
      const bar = (n, colour) => `<span style="display:inline-block;height:10px;width:${Math.round(200 * n / most)}px;background:${colour}"></span>`;
      return `<tr><td>${b}</td><td class="num">${trained}</td><td class="num">${dropped}</td>` +
        `<td class="num">${Math.round(share * 100)}%</td><td>${bar(trained, "#2563eb")}${bar(dropped, "#dc2626")}</td></tr>`;
    }).join("");
    lengthsCard.innerHTML = "<h2>groups by mean completion length (tokens): trained vs dropped stale</h2>" + meansLine +
      "<table style=\"font-size:12px;border-spacing:8px 2px\"><tr><th>length</th><th>trained</th><th>dropped stale</th>" +
      `<th>dropped share</th><th></th></tr>${rows}</table>`;
  }

  function width(chart) { return Math.max(300, chart.card.clientWidth - 16); }

  function ensurePlot(chart) {
    if (chart.plot) return;
    chart.card.querySelector(".empty").remove();
    chart.plot = new uPlot({
      width: width(chart), height: 220,
      scales: { x: { time: state.x === "time" } },
      series: [{}],
      axes: [{}, { size: 60 }],
      legend: { live: true },
    }, chart.data, chart.card);
  }

  function seriesIndex(chart, key, source) {
    const name = `${key} (${source})`;
    let i = chart.index[name];
    if (i !== undefined) return i;
    ensurePlot(chart);
    i = chart.series.length + 1;
    chart.series.push(name);
    chart.index[name] = i;
    chart.data.push(new Array(chart.data[0].length).fill(null));
    chart.plot.addSeries({ label: name, stroke: COLOURS[(i - 1) % COLOURS.length], width: 1.5, spanGaps: true }, i);
    return i;
  }

  function add(ev) {
    state.events += 1;
    state.lastSeq = ev.seq;
    const source = ev.component + "/" + ev.id;
    for (const k of Object.keys(ev.values)) {
      const m = LENGTH_KEY.exec(k);
      if (m && Number.isFinite(ev.values[k])) { (state.lengths[m[2]] ||= { trained: 0, dropped_stale: 0 })[m[1]] = ev.values[k]; lengthsDirty = true; }
      const mean = /^lengths\/mean_(trained|dropped_stale)$/.exec(k);
      if (mean && Number.isFinite(ev.values[k])) { (state.lengthMeans ||= { trained: 0, dropped_stale: 0 })[mean[1]] = ev.values[k]; lengthsDirty = true; }
    }
    for (const chart of charts) {
      const keys = chart.def.match ? Object.keys(ev.values).filter((k) => chart.def.match.test(k)).sort() : chart.def.keys;
      const hits = keys.filter((k) => k in ev.values && Number.isFinite(ev.values[k]));
      if (!hits.length) continue;
      const cols = hits.map((k) => seriesIndex(chart, k, source));
      const values = {};
      hits.forEach((k, j) => { values[cols[j]] = ev.values[k]; state.latest[k] = ev.values[k]; });
      chart.rows.push({ t: ev.t, step: ev.step, values });
      if (chart.rows.length > MAX_POINTS) chart.rows.shift();
      state.points[chart.def.name] += 1;
      chart.dirty = true;
    }
  }

  // The x of a row: broker time, or the learner step (events without a step are left out).
  function rebuild(chart) {
    const rows = state.x === "time" ? chart.rows : chart.rows.filter((r) => r.step !== null && r.step !== undefined)
      .slice().sort((a, b) => a.step - b.step);
    const data = [rows.map((r) => (state.x === "time" ? r.t : r.step))];
    for (let c = 1; c <= chart.series.length; c++) data.push(rows.map((r) => (c in r.values ? r.values[c] : null)));
    chart.data = data;
    state.xs[chart.def.name] = data[0];
  }

  function setX(x) {
    state.x = x;
    document.getElementById("xaxis").value = x;
    for (const chart of charts) {
      if (!chart.plot) continue;
      const series = chart.series.slice();
      chart.plot.destroy();
      chart.plot = null;
      chart.card.insertAdjacentHTML("beforeend", '<div class="empty"></div>');
      ensurePlot(chart);
      series.forEach((name, j) => chart.plot.addSeries({ label: name, stroke: COLOURS[j % COLOURS.length], width: 1.5, spanGaps: true }, j + 1));
      chart.dirty = true;
    }
  }
  document.getElementById("xaxis").value = state.x;
  document.getElementById("xaxis").addEventListener("change", (e) => setX(e.target.value));
  window.rlstreamSetX = setX;

  function redraw() {
    if (lengthsDirty) { showLengths(); lengthsDirty = false; }
    for (const chart of charts) {
      if (chart.dirty && chart.plot) { rebuild(chart); chart.plot.setData(chart.data); chart.dirty = false; }
    }
    const shown = ["reward/mean", "policy/kl", "loss/total", "buffer/staleness_max"]
      .filter((k) => k in state.latest).map((k) => `${k} ${Number(state.latest[k]).toPrecision(4)}`);
    document.getElementById("latest").textContent = `${state.events} events` + (shown.length ? " · " + shown.join(" · ") : "");
  }
  setInterval(redraw, 250);
  window.addEventListener("resize", () => charts.forEach((c) => c.plot && c.plot.setSize({ width: width(c), height: 220 })));

  // where the time goes: /api/stages (the server decides the bottleneck from the heartbeats)
  const stagesCard = document.createElement("div");
  stagesCard.className = "card";
  stagesCard.id = "stages";
  stagesCard.innerHTML = "<h2>where the time goes (s per loop pass)</h2><div class=\"empty\">no phase figures yet</div>";
  document.getElementById("charts").prepend(stagesCard);
  function showStages(s) {
    state.stages = s;
    const names = Object.keys(s.stages || {});
    if (!names.length) return;
    const rows = names.map((name) => {
      const st = s.stages[name];
      const phases = Object.entries(st.phases).map(([p, v]) => `${p} ${Number(v).toPrecision(3)}`).join(" · ");
      const mark = name === s.bottleneck ? " <b>← bottleneck</b>" : "";
      return `<tr><td>${name}${mark}</td><td>${st.instances}</td><td>${Math.round(st.busy * 100)}% busy</td><td>${phases}</td></tr>`;
    }).join("");
    stagesCard.innerHTML = `<h2>where the time goes (s per loop pass) · bottleneck: ${s.bottleneck || "-"}</h2>` +
      `<table style="font-size:12px;border-spacing:8px 2px">${rows}</table>`;
  }
  function pollStages() { fetch("/api/stages").then((r) => r.json()).then(showStages).catch(() => {}); }
  pollStages();
  setInterval(pollStages, 2000);


  // ---- samples: the learner's logged completions (samples.jsonl), filtered and ranked by the server
  const FIXED = ["step", "prompt", "completion", "reward"];
  const TAIL = ["policy_version", "staleness", "finish_reason", "length"];
  function cell(v, cls) {
    const td = document.createElement("td");
    if (cls) td.className = cls;
    td.textContent = v === null || v === undefined ? "" : typeof v === "number" ? Number(v).toPrecision(4).replace(/\.?0+$/, "") : String(v);
    return td;
  }
  function promptText(p) {
    return Array.isArray(p) ? p.map((m) => `${m.role}: ${m.content}`).join("\n") : p;
  }
  // a multi-turn episode, turn by turn: the model's turns (trained on) apart from the environment's (masked)
  function turnsCell(turns) {
    const td = document.createElement("td");
    td.className = "text";
    for (const t of turns) {
      const div = document.createElement("div");
      div.className = t.kind === "model" ? "turn model" : "turn env";
      const tag = document.createElement("b");
      tag.textContent = `${t.kind === "model" ? "model" : "env"} · ${t.tokens} tok `;
      div.appendChild(tag);
      div.appendChild(document.createTextNode(t.text));
      td.appendChild(div);
    }
    return td;
  }
  function showSamples(out) {
    state.samples = out;
    const cols = [...FIXED, ...out.terms, ...TAIL];
    const head = document.getElementById("samples-head");
    head.innerHTML = "";
    const tr = document.createElement("tr");
    cols.forEach((c) => { const th = document.createElement("th"); th.textContent = c; tr.appendChild(th); });
    head.appendChild(tr);
    const body = document.getElementById("samples-body");
    body.innerHTML = "";
    for (const r of out.rows) {
      const row = document.createElement("tr");
      for (const c of cols) {
        if (c === "completion" && Array.isArray(r.turns)) { row.appendChild(turnsCell(r.turns)); continue; }
        const v = c === "prompt" ? promptText(r.prompt) : r[c];
        row.appendChild(cell(v, c === "prompt" || c === "completion" ? "text" : typeof v === "number" ? "num" : ""));
      }
      body.appendChild(row);
    }
    const stepSel = document.getElementById("samples-step");
    const chosen = stepSel.value;
    stepSel.innerHTML = '<option value="">every step</option>' + out.steps.map((s) => `<option value="${s}">step ${s}</option>`).join("");
    stepSel.value = chosen;
    document.getElementById("samples-count").textContent = `${out.rows.length} of ${out.matched} shown`;
  }
  function loadSamples() {
    const q = new URLSearchParams({ q: document.getElementById("samples-q").value, order: document.getElementById("samples-order").value,
                                    step: document.getElementById("samples-step").value, limit: "50" });
    return fetch("/api/samples?" + q).then((r) => (r.ok ? r.json() : null)).then((out) => { if (out) showSamples(out); });
  }
  ["samples-q", "samples-order", "samples-step"].forEach((id) => document.getElementById(id).addEventListener("input", loadSamples));
  window.rlstreamLoadSamples = loadSamples;

  fetch("/api/info").then((r) => r.json()).then((info) => {
    document.getElementById("run").textContent = info.run;
    if (info.samples) { loadSamples(); setInterval(loadSamples, 5000); }
    else document.getElementById("samples-count").textContent = "give the dashboard the RUN_DIR to see samples";
  });
  const status = document.getElementById("state");
  const source = new EventSource("/events");
  source.addEventListener("hello", () => { state.connected = true; status.textContent = "live"; status.className = "live"; });
  source.onmessage = (msg) => add(JSON.parse(msg.data));
  source.onerror = () => { state.connected = false; status.textContent = "reconnecting"; status.className = "down"; };
})();
