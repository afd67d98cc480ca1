// The live dashboard: polls /v1/dashboard and draws its charts with uPlot (vendor/, no CDN).
// The charts exist from the start (axes, no data) and are filled from the first answer on.
// A pause in traffic is drawn as 0, never as a gap. A legend shows the point under the cursor,
// and the latest point when the cursor is elsewhere. For the browser test, each chart's element
// carries data-points (points with a non-zero value) and window.charts holds the uPlot objects.
"use strict";

const POLL_MS = 2000;
const HEIGHT = 200; // of the plot and its axes; uPlot puts the legend below it
const COLORS = { blue: "#2563eb", amber: "#f59e0b", red: "#dc2626", green: "#16a34a", violet: "#7c3aed" };
const charts = (window.charts = {});

function fmt(v, digits) {
  if (v === null || v === undefined) return "–";
  if (Math.abs(v) >= 1000) return Math.round(v).toLocaleString();
  return Number(v).toFixed(digits === undefined ? (Math.abs(v) < 10 ? 2 : 1) : digits);
}
function pct(v) { return v === null || v === undefined ? "–" : (100 * v).toFixed(1) + " %"; }
function zero(values) { return values.map((v) => (v === null || v === undefined ? 0 : v)); }
function setText(id, text) { document.getElementById(id).textContent = text; }

// uPlot's legend shows the cursor's point, and dashes when there is none: show the latest instead.
function showLatest(u) {
  if (u.cursor.idx === null || u.cursor.idx === undefined) u.setLegend({ idx: u.data[0].length - 1 });
}

function line(label, stroke, extra) {
  return Object.assign({ label, stroke, width: 2, points: { show: false }, value: (u, v) => fmt(v) }, extra);
}

// series: uPlot series after the x one; opts: more uPlot options (scales, axes).
function makeChart(id, series, opts) {
  const box = document.getElementById(id);
  const options = Object.assign(
    {
      width: box.clientWidth,
      height: HEIGHT,
      padding: [null, 28, null, null], // room on the right for the last time label (null: uPlot's own)
      series: [{}, ...series],
      scales: { x: { time: true }, y: { range: (u, min, max) => [Math.min(0, min), max > 0 ? max * 1.1 : 1] } },
      axes: [{ values: "{HH}:{mm}:{ss}" }, { size: 50 }], // the time only: the date would take a line
      cursor: { drag: { x: false, y: false } },
      hooks: { setCursor: [showLatest] },
    },
    opts || {},
  );
  const empty = [[], ...series.map(() => [])];
  charts[id] = new uPlot(options, empty, box);
  box.dataset.points = "0";
  new ResizeObserver(() => charts[id].setSize({ width: box.clientWidth, height: HEIGHT })).observe(box);
}

function fill(id, data) {
  charts[id].setData(data);
  showLatest(charts[id]);
  const n = data[0].filter((_, i) => data.slice(1).some((s) => s[i] !== 0 && s[i] !== null)).length;
  document.getElementById(id).dataset.points = String(n);
}

function createCharts() {
  makeChart("c-throughput", [
    // texts/s as a pale area underneath, requests/s as a line on top: equal values stay visible
    line("texts/s", COLORS.amber, { fill: "rgba(245, 158, 11, 0.18)", width: 1 }),
    line("requests/s", COLORS.blue, { width: 2.5 }),
  ]);
  makeChart("c-latency", [line("p50", COLORS.blue), line("p95", COLORS.amber), line("p99", COLORS.red)]);
  makeChart("c-hits", [line("hit rate %", COLORS.green, { fill: "rgba(22, 163, 74, 0.12)" })], {
    scales: { x: { time: true }, y: { range: [0, 100] } },
  });
  makeChart("c-batches", [
    { label: "batches", stroke: COLORS.violet, fill: COLORS.violet, paths: uPlot.paths.bars({ size: [0.7, 40] }), points: { show: false } },
  ], {
    scales: { x: { time: false, distr: 2 }, y: { range: (u, min, max) => [0, max > 0 ? max * 1.1 : 1] } },
    axes: [{ label: "texts per batch", labelSize: 16 }, { size: 50 }],
    legend: { show: false }, // the latest bar is only the largest size: the axis says the rest
  });
  makeChart("c-queue", [line("queue depth", COLORS.violet, { paths: uPlot.paths.stepped({ align: 1 }), value: (u, v) => fmt(v, 0) })]);
  // Stacked: each series is drawn as the running total up to its tier, the legend shows its own count.
  const tier = (label, stroke, k) => ({
    label, stroke, fill: stroke, width: 0, points: { show: false },
    paths: uPlot.paths.stepped({ align: 1 }), value: (u, v, s, i) => (i === null ? "–" : fmt(tierCounts[k][i], 0)),
  });
  makeChart("c-tiers", [tier("high", COLORS.red, 2), tier("medium", COLORS.amber, 1), tier("low", COLORS.green, 0)]);
}
let tierCounts = [[], [], []];

function render(d) {
  const m = d.last_minute, s = d.since_start, now = d.now, series = d.series;
  setText("model", d.model || "loading");
  setText("uptime", `up ${fmt(d.uptime_s / 60, 1)} min`);
  setText("t-rps", fmt(m.requests_per_s));
  setText("t-tps", `${fmt(m.texts_per_s)} texts/s, last minute`);
  setText("t-lat", `${fmt(m.latency_ms.p50)} / ${fmt(m.latency_ms.p99)} ms`);
  setText("t-p95", `p95 ${fmt(m.latency_ms.p95)} ms, last minute`);
  setText("t-hit", pct(m.cache.hit_rate));
  setText("t-dedup", `${s.cache.deduplicated} texts de-duplicated since start`);
  setText("t-batch", fmt(m.batches.avg_size));
  setText("t-pad", `padding ${pct(m.batches.padding_ratio)}, last minute`);
  setText("t-queue", String(now.queue_depth));
  setText("t-tier", `tier ${now.tier}, ${now.in_flight} batch(es) in the model`);
  const r = s.rejections;
  setText("t-rej", `${r.overload} / ${r.deadline} / ${r.disconnect}`);
  const sv = s.savings;
  setText("t-saved", `${fmt(sv.model_s_saved_by_cache)} s`);
  setText("t-saved-sub", `beside ${fmt(sv.model_s_spent)} s of model time spent (${pct(sv.saved_fraction)} saved), since start`);

  const t = series.map((p) => p.t), col = (k, scale) => zero(series.map((p) => (p[k] === null ? null : p[k] * (scale || 1))));
  fill("c-throughput", [t, col("texts_per_s"), col("requests_per_s")]);
  fill("c-latency", [t, col("p50_ms"), col("p95_ms"), col("p99_ms")]);
  fill("c-hits", [t, col("hit_rate", 100)]);
  const sizes = Object.entries(s.batches.size_distribution).map(([k, v]) => [Number(k), v]).sort((a, b) => a[0] - b[0]);
  fill("c-batches", [sizes.map((e) => e[0]), sizes.map((e) => e[1])]);
  fill("c-queue", [t, col("queue_depth_max")]);
  tierCounts = ["low", "medium", "high"].map((k) => series.map((p) => p.tiers[k]));
  const low = tierCounts[0], medium = low.map((v, i) => v + tierCounts[1][i]), high = medium.map((v, i) => v + tierCounts[2][i]);
  fill("c-tiers", [t, high, medium, low]);
  summary(m, s);
  document.body.dataset.renders = String(Number(document.body.dataset.renders || 0) + 1);
}

function summary(m, s) {
  const rows = [
    ["requests/s", (w) => fmt(w.requests_per_s)],
    ["texts/s", (w) => fmt(w.texts_per_s)],
    ["p50 / p95 / p99 ms", (w) => `${fmt(w.latency_ms.p50)} / ${fmt(w.latency_ms.p95)} / ${fmt(w.latency_ms.p99)}`],
    ["queue wait, mean ms", (w) => fmt(w.queue_ms_mean)],
    ["model time per batch, mean ms", (w) => fmt(w.batches.inference_ms_mean)],
    ["cache hit rate", (w) => pct(w.cache.hit_rate)],
    ["batches (avg size)", (w) => `${w.batches.count} (${fmt(w.batches.avg_size)})`],
    ["tiers low / medium / high", (w) => `${w.batches.tiers.low} / ${w.batches.tiers.medium} / ${w.batches.tiers.high}`],
    ["rejected 503 / 504 / gone", (w) => `${w.rejections.overload} / ${w.rejections.deadline} / ${w.rejections.disconnect}`],
    ["model s spent / saved by the cache", (w) => `${fmt(w.savings.model_s_spent)} / ${fmt(w.savings.model_s_saved_by_cache)}`],
  ];
  document.getElementById("summary").innerHTML = "<tr><th></th><th>last minute</th><th>since start</th></tr>" +
    rows.map(([name, f]) => `<tr><td>${name}</td><td>${f(m)}</td><td>${f(s)}</td></tr>`).join("");
}

// With API_KEY set, open /dashboard#key=<one of the keys>: the fragment never leaves the browser.
function authHeaders() {
  const key = new URLSearchParams(location.hash.slice(1)).get("key");
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function poll() {
  const status = document.getElementById("status");
  try {
    const response = await fetch("/v1/dashboard", { cache: "no-store", headers: authHeaders() });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    render(await response.json());
    status.textContent = "live";
    status.className = "ok";
  } catch (err) {
    status.textContent = `offline (${err.message})`;
    status.className = "down";
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

createCharts();
poll();
