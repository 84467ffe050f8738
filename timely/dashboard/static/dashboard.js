// The live dashboard: polls /api/state, draws with Chart.js (shipped in this folder), posts rebalances.
"use strict";
const COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"];
const color = (w) => COLORS[((w % COLORS.length) + COLORS.length) % COLORS.length];
const $ = (id) => document.getElementById(id);
const fmt = (x) => (x >= 100 ? Math.round(x).toLocaleString("en") : (Math.round(x * 10) / 10).toString());
const HISTORY = 120;
// Names (operators, dataflows) are the job's text: escaped wherever they go into markup.
const esc = (s) => String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;");

const workersChart = new Chart($("workers-chart"), {
  type: "bar", data: { labels: [], datasets: [{ label: "busy ms/s", data: [], backgroundColor: [] }] },
  options: { animation: false, scales: { y: { beginAtZero: true, suggestedMax: 1000 } } },
});
const lagChart = new Chart($("lag-chart"), {
  type: "line", data: { labels: [], datasets: [
    { label: "records/s", data: [], borderColor: "#4e79a7", yAxisID: "y", pointRadius: 0 },
    { label: "lag (s)", data: [], borderColor: "#e15759", yAxisID: "lag", pointRadius: 0 }] },
  options: { animation: false, scales: { y: { beginAtZero: true, position: "left" },
    lag: { beginAtZero: true, position: "right", grid: { drawOnChartArea: false } } } },
});

function drawGraph(graph, rates) {
  const svg = $("graph");
  const names = Object.keys(graph || {});
  let html = "", x0 = 10, row = 0;
  for (const df of names) {
    const { nodes, edges } = graph[df];
    const depth = {};
    for (const [i] of nodes) depth[i] = 0;
    for (let pass = 0; pass < nodes.length; pass++)
      for (const [a, b] of edges) if (b > a && depth[b] <= depth[a]) depth[b] = depth[a] + 1;
    const perDepth = {}, pos = {};
    for (const [i] of nodes) { const d = depth[i]; perDepth[d] = (perDepth[d] || 0) + 1; pos[i] = [d, perDepth[d] - 1]; }
    const at = (i) => [x0 + pos[i][0] * 150, 20 + (row + pos[i][1]) * 34];
    for (const [a, b] of edges) {
      const [x1, y1] = at(a), [x2, y2] = at(b);
      html += `<line x1="${x1 + 130}" y1="${y1 + 10}" x2="${x2}" y2="${y2 + 10}" stroke="#999"/>`;
    }
    for (const [i, name] of nodes) {
      const [x, y] = at(i), r = rates[df + "/" + i] || 0;
      html += `<g><rect x="${x}" y="${y}" width="130" height="26" rx="4" fill="#e8eef7" stroke="#23395d"/>` +
        `<text x="${x + 4}" y="${y + 11}" font-size="9">${esc(name.slice(0, 26))}</text>` +
        `<text x="${x + 4}" y="${y + 22}" font-size="9" fill="#555">${fmt(r)} rec/s</text></g>`;
    }
    row += Math.max(...Object.values(perDepth), 1) + 1;
  }
  svg.setAttribute("height", String(Math.max(60, row * 34 + 10)));
  svg.innerHTML = html;
}

function drawBins(bins, steering) {
  const names = Object.keys(bins || {}).filter((n) => !bins[n].retired);  // (retired: a completed operator's final counts)
  const box = $("bins");
  if (!names.length) { box.textContent = "no migratable operator"; $("bins-name").textContent = ""; return; }
  const agg = bins[names[0]];
  $("bins-name").textContent = names[0];
  const owners = steering && steering.table ? steering.table : agg.owner;
  const peak = Math.max(...agg.records_per_s, 1e-9);
  if (box.children.length !== owners.length) {
    box.innerHTML = owners.map((_, b) => `<div class="bin" data-bin="${b}"></div>`).join("");
  }
  owners.forEach((w, b) => {
    const cell = box.children[b], load = agg.records_per_s[b] / peak;
    cell.dataset.owner = String(w);
    cell.textContent = String(w);
    cell.title = `bin ${b}: worker ${w}, ${fmt(agg.records_per_s[b])} records/s, ${agg.state[b]} entries`;
    cell.style.background = color(w);
    cell.style.opacity = String(0.25 + 0.75 * load);
  });
}

function drawSteps(steering) {
  const body = $("steps").tBodies[0];
  if (!steering) { body.innerHTML = ""; return; }
  body.innerHTML = steering.steps.slice().reverse().map((s) =>
    `<tr data-state="${s.state}"><td>${s.migration}</td><td>${s.index + 1}/${s.steps}</td><td>${s.state}</td>` +
    `<td>${s.bins.join(" ")}</td><td>${s.duration == null ? (s.elapsed ? fmt(s.elapsed) : "") : s.duration.toFixed(3)}</td></tr>`).join("");
  const d = steering.decisions;
  // decided counts every decision; decisions holds the newest 16 only.
  $("decisions").textContent = d && d.length ? `AutoBalancer: ${steering.decided ?? d.length} decision(s), last moved bins ` +
    d[d.length - 1].bins.join(" ") : (d ? "AutoBalancer: watching" : "");
  $("needed").textContent = steering.needed == null ? "–" : String(steering.needed);
}

async function refresh() {
  let state;
  try {
    state = await (await fetch("/api/state", { cache: "no-store" })).json();
  } catch (e) {
    $("status").textContent = "job not reachable";
    return;
  }
  $("status").textContent = "live " + new Date().toLocaleTimeString();
  const rates = {};
  let total = 0, rate = 0;
  const rows = [];
  const perOp = {};
  for (const o of state.operators || []) {
    const key = o.dataflow + "/" + o.index;
    rates[key] = (rates[key] || 0) + o.records_in_per_s;
    total += o.records_in;
    rate += o.records_in_per_s;
    const p = perOp[key] || (perOp[key] = { df: o.dataflow, name: o.operator, inr: 0, outr: 0, busy: 0 });
    p.inr += o.records_in_per_s; p.outr += o.records_out_per_s; p.busy += o.busy_ms_per_s;
  }
  for (const p of Object.values(perOp))
    rows.push(`<tr><td>${esc(p.df)}</td><td>${esc(p.name)}</td><td>${fmt(p.inr)}</td><td>${fmt(p.outr)}</td><td>${fmt(p.busy)}</td></tr>`);
  $("operators").tBodies[0].innerHTML = rows.join("");
  $("records-total").textContent = String(total);
  $("total-rate").textContent = fmt(rate);
  drawGraph(state.graph, rates);
  const ws = state.workers || [];
  workersChart.data.labels = ws.map((w) => "worker " + w.worker);
  workersChart.data.datasets[0].data = ws.map((w) => w.busy_ms_per_s);
  workersChart.data.datasets[0].backgroundColor = ws.map((w) => color(w.worker));
  workersChart.update();
  const lags = (state.lags || []).map((l) => l.lag_s).filter((x) => x != null);
  lagChart.data.labels.push(new Date().toLocaleTimeString());
  lagChart.data.datasets[0].data.push(rate);
  lagChart.data.datasets[1].data.push(lags.length ? Math.max(...lags) : null);
  if (lagChart.data.labels.length > HISTORY) {
    lagChart.data.labels.shift();
    for (const d of lagChart.data.datasets) d.data.shift();
  }
  lagChart.update();
  drawBins(state.bins, state.steering);
  drawSteps(state.steering);
}

async function rebalance(body) {
  const out = $("rebalance-result");
  body.strategy = $("strategy").value;
  try {
    const reply = await (await fetch("/api/rebalance", { method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body) })).json();
    out.className = reply.ok ? "ok" : "error";
    out.textContent = reply.ok ? `migration ${reply.migration} started: ${reply.moves} bin(s) in ${reply.steps} step(s)`
      : "refused: " + reply.error;
  } catch (e) {
    out.className = "error";
    out.textContent = "request failed: " + e;
  }
  refresh();
}

$("rebalance-moves").addEventListener("click", () => {
  const text = $("moves").value.trim();
  const moves = text.split(/[\s,]+/).filter(Boolean).map((p) => p.split(":").map((x) => (/^-?\d+$/.test(x) ? Number(x) : x)));
  rebalance({ moves });
});
$("rebalance-balanced").addEventListener("click", () => rebalance({ balanced: true }));
refresh();
setInterval(refresh, 500);
