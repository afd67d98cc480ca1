// The live dashboard: polls /v1/dashboard and draws its charts with uPlot (vendor/, no CDN).
// The server sends running totals only (a reading of its registry at every 5-second step, and one
// now); every rate and percentile is computed here from two readings, as Prometheus' rate() and
// histogram_quantile() compute them from two scrapes.
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

// --- figures over a span, from two readings (a: its start, b: its end) ----------------------------
const TIERS = ["low", "medium", "high"];
function bound(le) { return le === "+Inf" ? Infinity : Number(le); }
function delta(a, b, key) { return (b.values[key] || 0) - (a.values[key] || 0); }
function ratio(part, whole, digits) { return whole ? Number((part / whole).toFixed(digits === undefined ? 4 : digits)) : null; }

// --8<-- [start:quantile]
// The q-quantile (0..1), in ms, of the observations between two readings of a histogram, interpolated
// inside the bucket it falls in (histogram_quantile); above the last finite bound, that bound.
function quantile(a, b, q, histogram) {
  const bounds = Object.keys(b[histogram]).sort((x, y) => bound(x) - bound(y));
  const counts = bounds.map((le) => b[histogram][le] - (a[histogram][le] || 0));
  if (!counts.length || counts[counts.length - 1] <= 0) return null;
  const rank = q * counts[counts.length - 1];
  let lower = 0, below = 0;
  for (let i = 0; i < bounds.length; i++) {
    if (counts[i] >= rank) {
      if (bound(bounds[i]) === Infinity) return Number((lower * 1e3).toFixed(3));
      return Number(((lower + (bound(bounds[i]) - lower) * (rank - below) / (counts[i] - below)) * 1e3).toFixed(3));
    }
    lower = bound(bounds[i]); below = counts[i];
  }
  return null;
}
// --8<-- [end:quantile]

function statuses(a, b) {
  const found = {};
  for (const key of Object.keys(b.values)) {
    if (!key.startsWith("requests_total ")) continue;
    const n = Math.round(delta(a, b, key));
    if (n) found[key.split(" ")[1]] = n;
  }
  return found;
}
function meanMs(a, b, histogram) {
  const count = delta(a, b, `${histogram}_count`);
  return count ? Number((delta(a, b, `${histogram}_sum`) / count * 1e3).toFixed(3)) : null;
}
function cache(a, b) {  // a Redis lookup follows a memory miss: hits add up, lookups are the memory tier's
  const hits = delta(a, b, "cache_hits_total memory") + delta(a, b, "cache_hits_total redis");
  return [hits, delta(a, b, "cache_hits_total memory") + delta(a, b, "cache_misses_total memory")];
}

// Everything a person asks about a span: rates, latency, cache, batches, rejections, model time.
function summary(a, b) {
  const seconds = Math.max(b.at - a.at, 1e-3), st = statuses(a, b);
  const requests = Object.values(st).reduce((x, y) => x + y, 0);
  const [hits, lookups] = cache(a, b), batches = delta(a, b, "batch_size_texts_count");
  const sizes = Object.keys(b.sizes).sort((x, y) => bound(x) - bound(y));
  const distribution = {};
  let before = 0;
  for (const le of sizes) {
    const n = b.sizes[le] - (a.sizes[le] || 0);
    if (n - before) distribution[String(bound(le))] = Math.round(n - before);
    before = n;
  }
  const spent = delta(a, b, "batch_inference_seconds_sum"), saved = delta(a, b, "cache_saved_model_seconds_total");
  return {
    seconds: Number(seconds.toFixed(1)), requests, requests_per_s: Number((requests / seconds).toFixed(2)),
    texts: Math.round(delta(a, b, "texts_total")), texts_per_s: Number((delta(a, b, "texts_total") / seconds).toFixed(2)),
    tokens: Math.round(delta(a, b, "tokens_total")), statuses: st,
    latency_ms: { p50: quantile(a, b, 0.5, "latency"), p95: quantile(a, b, 0.95, "latency"),
      p99: quantile(a, b, 0.99, "latency"), mean: meanMs(a, b, "request_duration_seconds") },
    queue_ms_mean: meanMs(a, b, "queue_wait_seconds"),
    cache: { hits: Math.round(hits), misses: Math.round(lookups - hits), hit_rate: ratio(hits, lookups),
      deduplicated: Math.round(delta(a, b, "deduplicated_texts_total")) },
    batches: { count: Math.round(batches), avg_size: ratio(delta(a, b, "batch_size_texts_sum"), batches, 2),
      size_distribution: distribution,
      tiers: Object.fromEntries(TIERS.map((t) => [t, Math.round(delta(a, b, `batches_total ${t}`))])),
      padding_ratio: ratio(delta(a, b, "batch_padding_tokens_total"), delta(a, b, "batch_tokens_sum")),
      inference_ms_mean: meanMs(a, b, "batch_inference_seconds") },
    rejections: { overload: (st["503"] || 0) + (st["429"] || 0), deadline: st["504"] || 0,
      disconnect: Math.round(delta(a, b, "rejected_requests_total disconnect")) },
    savings: { model_s_spent: Number(spent.toFixed(3)), model_s_saved_by_cache: Number(saved.toFixed(3)),
      saved_fraction: ratio(saved, saved + spent) },
  };
}

// One point of the charts: the step from a to b, drawn at the step's start.
function point(t, a, b) {
  const s = summary(a, b);
  return { t, seconds: Number(Math.max(b.at - a.at, 1e-3).toFixed(2)), requests_per_s: s.requests_per_s,
    texts_per_s: s.texts_per_s, p50_ms: s.latency_ms.p50, p95_ms: s.latency_ms.p95, p99_ms: s.latency_ms.p99,
    hit_rate: s.cache.hit_rate, avg_batch: s.batches.avg_size, queue_depth_max: Math.round(b.depth_max),
    tiers: s.batches.tiers };
}

// A point per step, oldest first: from the server's start (or the oldest reading kept) to now. The
// step under way ends now; it is left out while younger than 2 s (unless it is the only one), so
// the charts do not end on a fraction of a second that looks like a drop.
function series(d) {
  const step = d.step_s, start = { at: d.started, values: {}, latency: {}, sizes: {}, depth_max: 0 };
  const kept = d.readings, now = d.reading;
  // Once the oldest readings are dropped (after 5 minutes), the oldest kept one starts the charts.
  const marks = kept.length && kept[0].at - d.started > 2 * step ? kept : [start, ...kept];
  const points = [];
  for (let i = 1; i < marks.length; i++) points.push(point(Math.floor(marks[i - 1].at / step) * step, marks[i - 1], marks[i]));
  const last = marks[marks.length - 1];
  if (now.at - last.at >= 2 || !points.length) points.push(point(Math.floor(last.at / step) * step, last, now));
  return points;
}

// The last minute: from the oldest reading of the last 60 s (the server's start while it is younger).
function windows(d) {
  const start = { at: d.started, values: {}, latency: {}, sizes: {}, depth_max: 0 }, now = d.reading;
  const minuteAgo = now.at - d.started <= 60 ? start : d.readings.find((r) => r.at >= now.at - 60.5) || start;
  return { minute: summary(minuteAgo, now), since: summary(start, now) };
}

function render(d) {
  const { minute: m, since: s } = windows(d), now = d.now, points = series(d);
  setText("model", d.model || "loading");
  setText("uptime", `up ${fmt(d.uptime_s / 60, 1)} min`);
  setText("t-rps", fmt(m.requests_per_s));
  const span = `last ${Math.round(m.seconds)} s`; // idle seconds count too, as in rate()
  setText("t-tps", `${fmt(m.texts_per_s)} texts/s, ${span}`);
  setText("t-lat", `${fmt(m.latency_ms.p50)} / ${fmt(m.latency_ms.p99)} ms`);
  setText("t-p95", `p95 ${fmt(m.latency_ms.p95)} ms, ${span}`);
  setText("t-hit", pct(m.cache.hit_rate));
  setText("t-dedup", `${s.cache.deduplicated} texts de-duplicated since start`);
  setText("t-batch", fmt(m.batches.avg_size));
  setText("t-pad", `padding ${pct(m.batches.padding_ratio)}, ${span}`);
  setText("t-queue", String(now.queue_depth));
  setText("t-tier", `tier ${now.tier}, ${now.in_flight} batch(es) in the model`);
  const r = s.rejections;
  setText("t-rej", `${r.overload} / ${r.deadline} / ${r.disconnect}`);
  const sv = s.savings;
  setText("t-saved", `${fmt(sv.model_s_saved_by_cache)} s`);
  setText("t-saved-sub", `beside ${fmt(sv.model_s_spent)} s of model time spent (${pct(sv.saved_fraction)} saved), since start`);

  const t = points.map((p) => p.t), col = (k, scale) => zero(points.map((p) => (p[k] === null ? null : p[k] * (scale || 1))));
  fill("c-throughput", [t, col("texts_per_s"), col("requests_per_s")]);
  fill("c-latency", [t, col("p50_ms"), col("p95_ms"), col("p99_ms")]);
  fill("c-hits", [t, col("hit_rate", 100)]);
  const sizes = Object.entries(s.batches.size_distribution).map(([k, v]) => [Number(k), v]).sort((a, b) => a[0] - b[0]);
  fill("c-batches", [sizes.map((e) => e[0]), sizes.map((e) => e[1])]);
  fill("c-queue", [t, col("queue_depth_max")]);
  tierCounts = TIERS.map((k) => points.map((p) => p.tiers[k]));
  const low = tierCounts[0], medium = low.map((v, i) => v + tierCounts[1][i]), high = medium.map((v, i) => v + tierCounts[2][i]);
  fill("c-tiers", [t, high, medium, low]);
  summaryTable(m, s);
  document.body.dataset.renders = String(Number(document.body.dataset.renders || 0) + 1);
}

function summaryTable(m, s) {
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
