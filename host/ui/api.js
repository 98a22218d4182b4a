// The page's one way to the server: same-origin fetches with the API key (when the server
// asks for one) and a reader of server-sent events over a fetch (EventSource cannot send the
// key).

const KEY = "host.apiKey";

export class Unauthorized extends Error {}

export function key() {
  return sessionStorage.getItem(KEY) || "";
}

export function setKey(k) {
  if (k) sessionStorage.setItem(KEY, k);
  else sessionStorage.removeItem(KEY);
}

function headers(extra) {
  const h = { ...extra };
  const k = key();
  if (k) h["Authorization"] = "Bearer " + k;
  return h;
}

// A fetch that throws Unauthorized on 401 and an Error with the server's message on any
// other failure.
export async function call(path, { method = "GET", body, signal } = {}) {
  const init = { method, signal, headers: headers(body ? { "Content-Type": "application/json" } : {}) };
  if (body) init.body = JSON.stringify(body);
  const r = await fetch(path, init);
  if (r.status === 401) throw new Unauthorized((await errorText(r)) || "the API key is missing or wrong");
  if (!r.ok) throw new Error((await errorText(r)) || `${r.status} ${r.statusText}`);
  return r;
}

async function errorText(r) {
  const text = await r.text();
  try {
    const v = JSON.parse(text);
    return (v.error && (v.error.message || v.error)) || text;
  } catch {
    return text;
  }
}

export async function json(path, options) {
  return (await call(path, options)).json();
}

// Reads a text/event-stream body; calls onEvent(name, data) per event. Resolves at the end
// of the stream; rejects with an AbortError when `signal` aborts.
export async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
      let name = "message";
      const data = [];
      for (const line of block.split(/\r?\n/)) {
        if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) onEvent(name, data.join("\n"));
    }
  }
}

// Prometheus text to {name: value} (labels summed, so `host_requests_total` is all routes').
export function parseMetrics(text) {
  const out = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = line.match(/^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)/);
    if (!m) continue;
    const v = Number(m[3]);
    if (!Number.isFinite(v)) continue;
    out[m[1]] = (out[m[1]] || 0) + v;
  }
  return out;
}
