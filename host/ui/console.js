// The console: the model, live gauges from /metrics, and the plugin list as
// /v1/plugins/events streams it (a reload, a refused file or a quarantine shows within a
// second, without reloading the page).

import { Unauthorized, call, parseMetrics, readEvents } from "./api.js";
import { escape } from "./markdown.js";

const $ = (id) => document.getElementById(id);
const HISTORY = 60; // samples (one a second) in each chart

const GAUGES = [
  { id: "running", label: "requests running", value: (m) => m.host_requests_running },
  { id: "waiting", label: "requests waiting", value: (m) => m.host_queue_depth },
  { id: "rows", label: "batch rows", value: (m) => m.host_batch_rows },
  { id: "kv", label: "KV bytes", value: (m) => m.host_batch_kv_bytes, bytes: true },
  { id: "tps", label: "tokens/s generated", rate: "host_generation_tokens_total" },
  {
    id: "hits",
    label: "prefix-cache hit rate (tokens)",
    value: (m) => (m.host_prompt_tokens_total ? m.host_prompt_cache_tokens_total / m.host_prompt_tokens_total : 0),
    percent: true,
  },
];

const series = Object.fromEntries(GAUGES.map((g) => [g.id, []]));
let previous = null;

export function bytes(n) {
  if (n === undefined || n === null) return "—";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) (n /= 1000), i++;
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function format(g, v) {
  if (v === undefined || Number.isNaN(v)) return "—";
  if (g.bytes) return bytes(v);
  if (g.percent) return `${(v * 100).toFixed(0)}%`;
  return Number.isInteger(v) ? String(v) : v.toFixed(1);
}

function buildGauges() {
  const box = $("gauges");
  box.replaceChildren();
  for (const g of GAUGES) {
    const div = document.createElement("div");
    div.className = "gauge";
    div.id = "gauge-" + g.id;
    div.innerHTML = `<div class="gauge-label">${escape(g.label)}</div><div class="gauge-value">—</div><svg viewBox="0 0 ${HISTORY} 20" preserveAspectRatio="none"><polyline points=""/></svg>`;
    box.append(div);
  }
}

async function sampleMetrics() {
  const text = await (await call("/metrics")).text();
  const m = parseMetrics(text);
  const now = performance.now();
  for (const g of GAUGES) {
    let v;
    if (g.rate) {
      v = previous ? Math.max(0, ((m[g.rate] || 0) - (previous.m[g.rate] || 0)) / ((now - previous.at) / 1000)) : 0;
    } else v = g.value(m) || 0;
    const s = series[g.id];
    s.push(v);
    if (s.length > HISTORY) s.shift();
    const div = $("gauge-" + g.id);
    div.querySelector(".gauge-value").textContent = format(g, v);
    div.dataset.value = String(v);
    const max = Math.max(...s, g.percent ? 1 : 1e-9);
    const points = s.map((x, i) => `${i + HISTORY - s.length},${(20 - (x / max) * 19).toFixed(2)}`).join(" ");
    div.querySelector("polyline").setAttribute("points", points);
  }
  previous = { m, at: now };
}

function renderPlugins(list) {
  const body = $("plugins").querySelector("tbody");
  body.replaceChildren();
  for (const p of list) {
    const tr = document.createElement("tr");
    tr.dataset.name = p.name;
    tr.dataset.state = p.state;
    tr.className = "state-" + p.state;
    const cells = [
      p.name,
      (p.kinds || []).join(", "),
      p.version,
      p.state,
      p.calls,
      p.faults,
      p.quarantine_s ? `${p.quarantine_s} s left` : "",
      p.source,
      p.sha256 ? p.sha256.slice(0, 12) : "",
    ];
    for (const [i, c] of cells.entries()) {
      const td = document.createElement("td");
      td.textContent = String(c ?? "");
      td.className = ["name", "kinds", "version", "state", "calls", "faults", "quarantine", "source", "sha"][i];
      if (i === 8 && p.sha256) td.title = p.sha256;
      if (i === 3 && p.error) td.title = p.error;
      tr.append(td);
    }
    body.append(tr);
    if (p.error) {
      const er = document.createElement("tr");
      er.className = "plugin-error";
      er.innerHTML = `<td colspan="9">${escape(p.error)}</td>`;
      body.append(er);
    }
  }
}

// Follows /v1/plugins/events for as long as the page is open, reconnecting after a drop.
async function followPlugins(onPlugins) {
  for (;;) {
    try {
      const r = await call("/v1/plugins/events");
      $("plugins-live").textContent = "live";
      await readEvents(r, (name, data) => {
        if (name !== "plugins") return;
        const list = JSON.parse(data).data || [];
        renderPlugins(list);
        onPlugins(list);
      });
    } catch (e) {
      if (e instanceof Unauthorized) {
        document.dispatchEvent(new CustomEvent("host-unauthorized"));
        return;
      }
    }
    $("plugins-live").textContent = "reconnecting…";
    await new Promise((r) => setTimeout(r, 1000));
  }
}

export async function start(modelInfo, onPlugins) {
  const facts = [
    ["name", modelInfo.id],
    ["type", modelInfo.model_type],
    ["context length", modelInfo.context_length],
    ["longest request", modelInfo.max_model_len],
    ["device", modelInfo.device],
    ["quantization", modelInfo.quantization],
    ["weights", bytes(modelInfo.weight_bytes)],
    ["memory budget", bytes(modelInfo.memory_budget_bytes)],
  ];
  $("model-info").replaceChildren(
    ...facts.flatMap(([k, v]) => {
      const dt = document.createElement("dt");
      dt.textContent = k;
      const dd = document.createElement("dd");
      dd.textContent = v ?? "—";
      return [dt, dd];
    }),
  );
  buildGauges();
  const tick = () => sampleMetrics().catch(() => {});
  tick();
  setInterval(tick, 1000);
  followPlugins(onPlugins);
}
