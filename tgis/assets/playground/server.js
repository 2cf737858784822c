// The server panel: the model, its backend and limits from /info; the queue, batch, KV cache,
// decode throughput and time to first token from /metrics, read every few seconds while the
// panel is shown.

import { get } from "./api.js";
import { el } from "./store.js";

const REFRESH_MS = 2000;
const HISTORY = 90; // samples kept for the throughput chart (3 minutes)
let timer = null;
let previous = null;
const history = [];
const $ = (id) => document.getElementById(id);

// Prometheus' text format to samples: [{name, labels, value}].
export function parseMetrics(text) {
  const samples = [];
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = /^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/.exec(line);
    if (!m) continue;
    const labels = {};
    for (const l of (m[2] ?? "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[l[1]] = l[2].replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
    samples.push({ name: m[1], labels, value: Number(m[3]) });
  }
  return samples;
}

// The sum of a metric's samples whose labels include `match`; null when it has none.
export function total(samples, name, match = {}) {
  let sum = null;
  for (const s of samples) {
    if (s.name !== name || !Object.entries(match).every(([k, v]) => s.labels[k] === v)) continue;
    sum = (sum ?? 0) + s.value;
  }
  return sum;
}

// The figures of one scrape; rates need the one before.
export function figures(samples, at, before) {
  const f = {
    at,
    queue: total(samples, "tgi_queue_size"),
    batch: total(samples, "tgi_batch_current_size"),
    kv: total(samples, "tgis_kv_cache_usage"),
    ok: total(samples, "tgi_request_success"),
    failed: total(samples, "tgi_request_failure") ?? 0,
    // Decode steps emit one token per running sequence, plus the accepted speculative ones.
    decoded:
      (total(samples, "tgi_batch_inference_batch_size_sum", { method: "next_token" }) ?? 0) +
      (total(samples, "tgis_speculative_accepted_tokens") ?? 0),
    ttftSum: total(samples, "tgis_request_time_to_first_token_seconds_sum") ?? 0,
    ttftCount: total(samples, "tgis_request_time_to_first_token_seconds_count") ?? 0,
    hit: total(samples, "tgis_prefix_cache_hit_tokens"),
    queried: total(samples, "tgis_prefix_cache_queried_tokens"),
  };
  f.tokensPerSecond = before && at > before.at ? Math.max(0, (f.decoded - before.decoded) / ((at - before.at) / 1000)) : null;
  const finished = before ? f.ttftCount - before.ttftCount : 0;
  f.ttft = finished > 0 ? (f.ttftSum - before.ttftSum) / finished : (before?.ttft ?? (f.ttftCount ? f.ttftSum / f.ttftCount : null));
  return f;
}

function fixed(v, digits = 0) {
  return v === null || v === undefined ? "—" : v.toFixed(digits);
}

function showLive(f) {
  const rows = [
    ["Queued requests", fixed(f.queue)],
    ["Running sequences", fixed(f.batch)],
    ["Decode tokens/s", fixed(f.tokensPerSecond, 1)],
    ["Time to first token", f.ttft === null ? "—" : `${Math.round(f.ttft * 1000)} ms`],
    ["KV cache in use", f.kv === null ? "—" : `${(f.kv * 100).toFixed(1)}%`],
    ["Prefix cache hits", f.queried ? `${((f.hit / f.queried) * 100).toFixed(1)}% of prompt tokens` : "—"],
    ["Requests", `${fixed(f.ok)} ok · ${fixed(f.failed)} failed`],
  ];
  $("live").replaceChildren(...rows.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { text: v })]));
}

function drawChart() {
  const canvas = $("throughput");
  // Drawn at the canvas's shown size and the screen's pixel density, so it stays sharp.
  const scale = window.devicePixelRatio || 1;
  canvas.width = Math.round(canvas.clientWidth * scale);
  canvas.height = Math.round(canvas.clientHeight * scale);
  const ctx = canvas.getContext("2d");
  ctx.scale(scale, scale);
  const width = canvas.clientWidth;
  const height = canvas.clientHeight;
  ctx.clearRect(0, 0, width, height);
  const values = history.filter((v) => v !== null); // the first scrape has no rate yet
  const top = Math.max(1, ...values);
  ctx.strokeStyle = getComputedStyle(canvas).color;
  ctx.lineWidth = 2;
  ctx.beginPath();
  values.forEach((v, i) => {
    const x = width - (values.length - 1 - i) * (width / (HISTORY - 1));
    const y = height - 4 - (v / top) * (height - 16);
    if (i) ctx.lineTo(x, y);
    else ctx.moveTo(x, y);
  });
  ctx.stroke();
  ctx.fillStyle = ctx.strokeStyle;
  ctx.font = "11px sans-serif";
  ctx.fillText(`${top.toFixed(0)} tokens/s`, 4, 11);
}

async function refresh() {
  try {
    const text = await get("metrics", { text: true });
    const f = figures(parseMetrics(text), performance.now(), previous);
    previous = f;
    history.push(f.tokensPerSecond);
    if (history.length > HISTORY) history.shift();
    showLive(f);
    drawChart();
    $("live-state").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (e) {
    $("live-state").textContent = `metrics unavailable: ${e.message}`;
  }
}

export function watch(on) {
  clearInterval(timer);
  timer = null;
  if (!on) return;
  refresh();
  timer = setInterval(refresh, REFRESH_MS);
}

const INFO_FIELDS = [
  ["model_id", "Model"],
  ["model_sha", "Revision"],
  ["model_dtype", "Dtype"],
  ["backend", "Backend"],
  ["model_device_type", "Device"],
  ["model_kind", "Kind"],
  ["runtime.engine", "Engine"],
  ["runtime.attention", "Attention"],
  ["runtime.weights", "Weights"],
  ["runtime.quantization", "Quantization"],
  ["runtime.kv_cache_dtype", "KV cache dtype"],
  ["runtime.kv_tokens", "KV cache tokens"],
  ["runtime.cuda_graphs", "CUDA graphs (batch sizes)"],
  ["runtime.compiled_decode", "Compiled decode (batch sizes)"],
  ["max_input_tokens", "Max input tokens"],
  ["max_total_tokens", "Max total tokens"],
  ["max_batch_prefill_tokens", "Max batch prefill tokens"],
  ["max_batch_total_tokens", "Max batch total tokens"],
  ["max_batch_size", "Max batch size"],
  ["max_concurrent_requests", "Max concurrent requests"],
  ["max_best_of", "Max best_of"],
  ["max_stop_sequences", "Max stop sequences"],
  ["max_top_n_tokens", "Max top_n_tokens"],
  ["max_client_batch_size", "Max client batch size"],
  ["version", "tgis version"],
];

function pick(obj, path) {
  return path.split(".").reduce((o, k) => (o && typeof o === "object" ? o[k] : undefined), obj);
}

export function showInfo(info) {
  const rows = [];
  for (const [path, label] of INFO_FIELDS) {
    const v = pick(info, path);
    if (v === undefined || v === null || (Array.isArray(v) && !v.length)) continue;
    rows.push(el("dt", { text: label }), el("dd", { text: Array.isArray(v) ? v.join(", ") : String(v) }));
  }
  $("info").replaceChildren(...rows);
}
