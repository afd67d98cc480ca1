// The live dashboard: polls /v1/dashboard and draws small SVG charts. No library, no CDN.
// Each chart's element gets data-points="<n>": how many points carry data (the browser test reads it).
"use strict";

const POLL_MS = 2000;
const W = 600, H = 190, PAD = { l: 44, r: 10, t: 8, b: 22 };
const COLORS = ["#2563eb", "#f59e0b", "#dc2626", "#16a34a", "#7c3aed"];
const SVGNS = "http://www.w3.org/2000/svg";

function el(tag, attrs, text) {
  const node = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function fmt(v, digits) {
  if (v === null || v === undefined) return "–";
  if (Math.abs(v) >= 1000) return Math.round(v).toLocaleString();
  return Number(v).toFixed(digits === undefined ? (Math.abs(v) < 10 ? 2 : 1) : digits);
}

function frame(svg, ymin, ymax, unit) {
  const ih = H - PAD.t - PAD.b;
  const step = (ymax - ymin) / 4;
  for (let i = 0; i <= 4; i++) {
    const y = PAD.t + ih - (ih * i) / 4;
    const v = ymin + step * i;
    const zero = Math.abs(v) < step / 1e6;
    svg.appendChild(el("line", { x1: PAD.l, x2: W - PAD.r, y1: y, y2: y, stroke: zero && ymin < 0 ? "#9ca3af" : "#e5e7eb" }));
    svg.appendChild(el("text", { x: PAD.l - 6, y: y + 4, "text-anchor": "end" }, fmt(zero ? 0 : v) + (unit || "")));
  }
}

// A range with four equal, round steps that holds lo..hi and has a gridline at zero.
function niceRange(lo, hi) {
  if (lo >= 0) return [0, niceMax(hi)];
  let step = niceMax((hi - lo) / 4);
  for (;;) {
    const below = Math.ceil(-lo / step - 1e-9);
    if (below <= 4 && (4 - below) * step >= hi) return [-below * step, (4 - below) * step];
    step = niceMax(step * 1.01);
  }
}

function legend(id, names) {
  const box = document.getElementById(id);
  box.innerHTML = names.map((n, i) => `<span><i style="background:${COLORS[i]}"></i>${n}</span>`).join("");
}

function count(values, zeroIsData) {
  return values.filter((v) => v !== null && v !== undefined && (zeroIsData || v > 0)).length;
}

// series: [{name, values}] over the same x (seconds before now); nulls break the line.
function lineChart(id, times, series, opts) {
  opts = opts || {};
  const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, role: "img" });
  const all = series.flatMap((s) => s.values).filter((v) => v !== null);
  // Savings go negative when batches cost more than lone calls would have.
  const [ymin, ymax] = opts.ymax ? [0, opts.ymax] : niceRange(Math.min(0, ...all), Math.max(0, ...all));
  frame(svg, ymin, ymax, opts.unit);
  const iw = W - PAD.l - PAD.r, ih = H - PAD.t - PAD.b;
  const t0 = times[0], t1 = times[times.length - 1] || t0 + 1;
  const x = (t) => PAD.l + (iw * (t - t0)) / Math.max(t1 - t0, 1);
  const y = (v) => PAD.t + ih - (ih * (Math.min(v, ymax) - ymin)) / (ymax - ymin);
  const ago = (sec) => (sec >= 120 ? `-${fmt(sec / 60, 1)} min` : `-${Math.round(sec)} s`);
  const span = t1 - t0 + (opts.step || 0);
  for (const [label, frac] of [[ago(span), 0], [ago(span / 2), 0.5], ["now", 1]]) {
    svg.appendChild(el("text", { x: PAD.l + iw * frac, y: H - 6, "text-anchor": frac === 0 ? "start" : frac === 1 ? "end" : "middle" }, label));
  }
  let points = 0;
  series.forEach((s, i) => {
    let d = "", pen = false;
    s.values.forEach((v, j) => {
      if (v === null || v === undefined) { pen = false; return; }
      d += `${pen ? "L" : "M"}${x(times[j]).toFixed(1)},${y(v).toFixed(1)}`;
      pen = true;
    });
    if (d) svg.appendChild(el("path", { d, fill: "none", stroke: COLORS[i], "stroke-width": 2, "stroke-linejoin": "round" }));
    points += count(s.values, opts.zeroIsData);
  });
  place(id, svg, points);
  legend("l" + id.slice(1), series.map((s) => s.name));
}

// bars: [{label, parts: [v, ...]}], stacked; names: one per part.
function barChart(id, bars, names, opts) {
  opts = opts || {};
  const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, role: "img" });
  const ymax = niceMax(Math.max(0, ...bars.map((b) => b.parts.reduce((a, v) => a + v, 0))));
  frame(svg, 0, ymax);
  const iw = W - PAD.l - PAD.r, ih = H - PAD.t - PAD.b;
  const slot = iw / Math.max(bars.length, 1), bw = Math.max(1, slot * 0.7);
  const every = Math.ceil(bars.length / 12);
  let points = 0;
  bars.forEach((b, i) => {
    let top = PAD.t + ih;
    b.parts.forEach((v, k) => {
      if (!(v > 0)) return;
      const h = (ih * v) / ymax;
      top -= h;
      svg.appendChild(el("rect", { x: PAD.l + i * slot + (slot - bw) / 2, y: top, width: bw, height: h, fill: COLORS[k] }));
    });
    if (b.parts.some((v) => v > 0)) points += 1;
    if (b.label && i % every === 0) {
      svg.appendChild(el("text", { x: PAD.l + i * slot + slot / 2, y: H - 6, "text-anchor": "middle" }, b.label));
    }
  });
  place(id, svg, points);
  legend("l" + id.slice(1), names);
}

function place(id, svg, points) {
  const box = document.getElementById(id);
  box.replaceChildren(svg);
  box.dataset.points = String(points);
}

function setText(id, text) { document.getElementById(id).textContent = text; }
function pct(v) { return v === null || v === undefined ? "–" : (100 * v).toFixed(1) + " %"; }

function render(d) {
  const m = d.last_minute, s = d.since_start, now = d.now, series = d.series;
  setText("model", d.model || "loading");
  setText("uptime", `up ${fmt(d.uptime_s / 60, 1)} min`);
  setText("t-rps", fmt(m.requests_per_s));
  setText("t-tps", `${fmt(m.texts_per_s)} texts/s, last minute`);
  setText("t-lat", `${fmt(m.latency_ms.p50)} / ${fmt(m.latency_ms.p99)}`);
  setText("t-p95", `p95 ${fmt(m.latency_ms.p95)} ms, last minute`);
  setText("t-hit", pct(m.cache.hit_rate));
  setText("t-dedup", `${s.cache.deduplicated || 0} texts de-duplicated since start`);
  setText("t-batch", fmt(m.batches.avg_size));
  setText("t-pad", `padding ${pct(m.batches.padding_ratio)}, last minute`);
  setText("t-queue", String(now.queue_depth));
  setText("t-tier", `tier ${now.tier}, ${now.in_flight} batch in the model`);
  const r = s.rejections;
  setText("t-rej", `${r.overload} / ${r.deadline} / ${r.disconnect || 0}`);
  const sv = s.savings;
  setText("t-saved", `${fmt(sv.model_s_saved_by_cache + sv.model_s_saved_by_batching)} s`);
  setText("t-saved-sub", `cache ${fmt(sv.model_s_saved_by_cache)} s, batching ${fmt(sv.model_s_saved_by_batching)} s (${pct(sv.saved_fraction)})`);

  const t = series.map((p) => p.t), col = (k) => series.map((p) => p[k]);
  const step = d.step_s;
  const perSec = (k) => series.map((p) => p[k] / d.step_s);
  lineChart("c-throughput", t, [{ name: "requests/s", values: col("requests_per_s") }, { name: "texts/s", values: col("texts_per_s") }], { step });
  lineChart("c-latency", t, [{ name: "p50", values: col("p50_ms") }, { name: "p95", values: col("p95_ms") }, { name: "p99", values: col("p99_ms") }], { step });
  lineChart("c-hits", t, [{ name: "hit rate", values: series.map((p) => (p.hit_rate === null ? null : 100 * p.hit_rate)) }], { ymax: 100, zeroIsData: true, step });
  const sizes = s.batches.size_distribution;
  const largest = Math.max(1, ...Object.keys(sizes).map(Number));
  const bySize = Array.from({ length: largest }, (_, i) => ({ label: String(i + 1), parts: [sizes[i + 1] || 0] }));
  barChart("c-batches", bySize, ["batches by size (texts)"]);
  lineChart("c-queue", t, [{ name: "queue depth", values: col("queue_depth_max") }], { zeroIsData: true, step });
  barChart("c-tiers", series.map((p) => ({ label: "", parts: [p.tiers.low, p.tiers.medium, p.tiers.high] })), ["low", "medium", "high"]);
  lineChart("c-savings", t, [
    { name: "spent", values: perSec("spent_s") },
    { name: "saved by batching", values: perSec("saved_batch_s") },
    { name: "saved by cache", values: perSec("saved_cache_s") },
  ], { step });
  summary(m, s);
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
    ["rejected 503 / 504", (w) => `${w.rejections.overload} / ${w.rejections.deadline}`],
    ["model s spent / saved", (w) => `${fmt(w.savings.model_s_spent)} / ${fmt(w.savings.model_s_saved_by_cache + w.savings.model_s_saved_by_batching)}`],
  ];
  const table = document.getElementById("summary");
  table.innerHTML = "<tr><th></th><th>last minute</th><th>since start</th></tr>" +
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

poll();
