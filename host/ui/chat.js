// The chat: conversations kept in this browser (localStorage), replies streamed from
// /v1/chat/completions and rendered as Markdown, a stop button that aborts the request (the
// server stops the work as for any disconnect), edit and regenerate, and per-conversation
// settings: system prompt, sampling and the request's plugins.

import { Unauthorized, call, readEvents } from "./api.js";
import { escape, render } from "./markdown.js";

const STORE = "host.conversations";
const CURRENT = "host.current";
const $ = (id) => document.getElementById(id);

let conversations = [];
let current = null;
let running = null; // {controller, message}
let model = "";
let plugins = [];

const DEFAULT_SETTINGS = {
  system: "",
  temperature: "",
  top_p: "",
  top_k: "",
  min_p: "",
  max_tokens: "",
  seed: "",
  sampler: "",
  stop: [],
  constraintKind: "",
  constraint: "",
};

function load() {
  try {
    conversations = JSON.parse(localStorage.getItem(STORE) || "[]");
    if (!Array.isArray(conversations)) conversations = [];
  } catch {
    conversations = [];
  }
  const id = localStorage.getItem(CURRENT);
  current = conversations.find((c) => c.id === id) || conversations[0] || null;
}

function save() {
  localStorage.setItem(STORE, JSON.stringify(conversations));
  if (current) localStorage.setItem(CURRENT, current.id);
}

function newConversation() {
  const c = {
    id: (crypto.randomUUID && crypto.randomUUID()) || String(Date.now() + Math.random()),
    title: "",
    created: Date.now(),
    messages: [],
    settings: { ...DEFAULT_SETTINGS, ...(current ? current.settings : {}), stop: [...((current && current.settings.stop) || [])] },
  };
  conversations.unshift(c);
  current = c;
  save();
  renderAll();
  $("input").focus();
}

function select(id) {
  if (running) return;
  current = conversations.find((c) => c.id === id) || current;
  save();
  renderAll();
}

function renderList() {
  const ul = $("conversations");
  ul.replaceChildren();
  for (const c of conversations) {
    const li = document.createElement("li");
    const b = document.createElement("button");
    b.textContent = c.title || firstLine(c) || "New chat";
    b.className = "conversation" + (current && c.id === current.id ? " active" : "");
    b.dataset.id = c.id;
    b.addEventListener("click", () => select(c.id));
    li.append(b);
    ul.append(li);
  }
}

function firstLine(c) {
  const m = c.messages.find((m) => m.role === "user");
  return m ? m.content.split("\n")[0].slice(0, 40) : "";
}

function messageElement(m, index) {
  const div = document.createElement("div");
  div.className = `message ${m.role}`;
  div.dataset.index = index;
  if (m.state) div.dataset.state = m.state;
  const head = document.createElement("div");
  head.className = "message-head";
  head.textContent = m.role === "user" ? "You" : model || "assistant";
  if (m.role === "user") {
    const edit = document.createElement("button");
    edit.className = "edit";
    edit.type = "button";
    edit.textContent = "Edit";
    edit.addEventListener("click", () => startEdit(div, index));
    head.append(" ", edit);
  }
  div.append(head);
  if (m.reasoning) {
    const d = document.createElement("details");
    d.className = "reasoning";
    const s = document.createElement("summary");
    s.textContent = m.state === "streaming" && !m.content ? "Thinking…" : "Reasoning";
    const body = document.createElement("div");
    body.className = "reasoning-text";
    body.textContent = m.reasoning;
    d.append(s, body);
    div.append(d);
  }
  const content = document.createElement("div");
  content.className = "content";
  if (m.role === "assistant") content.innerHTML = render(m.content || "");
  else content.textContent = m.content;
  div.append(content);
  for (const t of m.tool_calls || []) {
    const tc = document.createElement("div");
    tc.className = "tool-call";
    tc.innerHTML = `<span class="badge">tool call</span> <code>${escape(t.name || "")}</code><pre>${escape(pretty(t.arguments))}</pre>`;
    div.append(tc);
  }
  if (m.error) {
    const e = document.createElement("div");
    e.className = "error";
    e.textContent = m.error;
    div.append(e);
  }
  if (m.role === "assistant" && (m.usage || m.state === "stopped")) {
    const f = document.createElement("div");
    f.className = "stats";
    const parts = [];
    if (m.usage) parts.push(`${m.usage.prompt_tokens} prompt + ${m.usage.completion_tokens} generated tokens`);
    if (m.tps) parts.push(`${m.tps.toFixed(1)} tok/s`);
    if (m.finish) parts.push(`finish: ${m.finish}`);
    if (m.state === "stopped") parts.push("stopped");
    f.textContent = parts.join(" · ");
    div.append(f);
  }
  return div;
}

function pretty(args) {
  try {
    return JSON.stringify(JSON.parse(args), null, 2);
  } catch {
    return args || "";
  }
}

function renderMessages() {
  const box = $("messages");
  box.replaceChildren(...(current ? current.messages.map(messageElement) : []));
  box.scrollTop = box.scrollHeight;
}

function renderAll() {
  renderList();
  renderMessages();
  renderSettings();
  $("title").value = current ? current.title : "";
  $("send").hidden = !!running;
  $("stop").hidden = !running;
  $("regenerate").disabled = !!running || !current || !current.messages.length;
}

let frame = 0;
function renderLast() {
  if (frame) return;
  frame = requestAnimationFrame(() => {
    frame = 0;
    const box = $("messages");
    const index = current.messages.length - 1;
    const old = box.querySelector(`.message[data-index="${index}"]`);
    const fresh = messageElement(current.messages[index], index);
    if (old) old.replaceWith(fresh);
    else box.append(fresh);
    box.scrollTop = box.scrollHeight;
  });
}

function startEdit(div, index) {
  if (running) return;
  const m = current.messages[index];
  const area = document.createElement("textarea");
  area.className = "edit-text";
  area.value = m.content;
  area.rows = Math.min(12, m.content.split("\n").length + 1);
  const ok = document.createElement("button");
  ok.type = "button";
  ok.className = "primary save-edit";
  ok.textContent = "Save and regenerate";
  const cancel = document.createElement("button");
  cancel.type = "button";
  cancel.textContent = "Cancel";
  div.querySelector(".content").replaceWith(area);
  div.append(ok, cancel);
  cancel.addEventListener("click", renderMessages);
  ok.addEventListener("click", () => {
    m.content = area.value;
    current.messages.length = index + 1;
    save();
    generate();
  });
}

// The request's body from the conversation's history and settings.
function requestBody() {
  const s = current.settings;
  const messages = [];
  if (s.system.trim()) messages.push({ role: "system", content: s.system });
  for (const m of current.messages) {
    if (m.role === "assistant" && m.state === "error" && !m.content) continue;
    messages.push({ role: m.role, content: m.content || "" });
  }
  const body = { model, messages, stream: true, stream_options: { include_usage: true } };
  const num = (k, int) => {
    if (s[k] === "" || s[k] === null || s[k] === undefined) return;
    const v = Number(s[k]);
    if (Number.isFinite(v)) body[k] = int ? Math.trunc(v) : v;
  };
  num("temperature");
  num("top_p");
  num("top_k", true);
  num("min_p");
  num("max_tokens", true);
  num("seed", true);
  const constraintPlugin = s.constraintKind.startsWith("plugin:") ? s.constraintKind.slice(7) : "";
  if (s.sampler || s.stop.length || constraintPlugin) {
    body.plugins = {};
    if (s.sampler) body.plugins.sampler = { name: s.sampler };
    if (s.stop.length) body.plugins.stop = s.stop.map((name) => ({ name }));
  }
  if (constraintPlugin) {
    // A constraint plugin loaded in the server; the text, when given, is its config (JSON).
    const ref = { name: constraintPlugin };
    if (s.constraint.trim()) {
      try {
        ref.config = JSON.parse(s.constraint);
      } catch (e) {
        throw new Error(`the config of constraint plugin ${constraintPlugin} does not parse as JSON: ${e.message}`);
      }
    }
    body.plugins.constraint = ref;
  } else if (s.constraintKind && s.constraint.trim()) {
    if (s.constraintKind === "json_schema") {
      let schema;
      try {
        schema = JSON.parse(s.constraint);
      } catch (e) {
        throw new Error("the constraint's JSON schema does not parse: " + e.message);
      }
      body.response_format = { type: "json_schema", json_schema: { name: "page", schema, strict: true } };
    } else body[s.constraintKind] = s.constraint;
  }
  return body;
}

async function generate() {
  let body;
  try {
    body = requestBody();
    $("settings-error").textContent = "";
  } catch (e) {
    $("settings-error").textContent = e.message;
    showSettings(true);
    return;
  }
  const message = { role: "assistant", content: "", reasoning: "", tool_calls: [], state: "streaming" };
  current.messages.push(message);
  const controller = new AbortController();
  running = { controller, message };
  renderAll();
  const started = performance.now();
  let first = 0;
  try {
    const r = await call("/v1/chat/completions", { method: "POST", body, signal: controller.signal });
    await readEvents(r, (_, data) => {
      if (data === "[DONE]") return;
      const v = JSON.parse(data);
      if (v.error) throw new Error(v.error.message || JSON.stringify(v.error));
      if (v.usage) message.usage = v.usage;
      for (const choice of v.choices || []) {
        const d = choice.delta || {};
        if (d.content) {
          if (!first) first = performance.now();
          message.content += d.content;
        }
        const reasoning = d.reasoning_content || d.reasoning;
        if (reasoning) {
          if (!first) first = performance.now();
          message.reasoning += reasoning;
        }
        for (const t of d.tool_calls || []) {
          const slot = (message.tool_calls[t.index || 0] ||= { name: "", arguments: "" });
          if (t.function && t.function.name) slot.name += t.function.name;
          if (t.function && t.function.arguments) slot.arguments += t.function.arguments;
        }
        if (choice.finish_reason) message.finish = choice.finish_reason;
      }
      renderLast();
    });
    message.state = "done";
  } catch (e) {
    if (e.name === "AbortError") message.state = "stopped";
    else {
      message.state = "error";
      message.error = e.message;
      if (e instanceof Unauthorized) document.dispatchEvent(new CustomEvent("host-unauthorized"));
    }
  }
  const seconds = (performance.now() - (first || started)) / 1000;
  if (message.usage && seconds > 0) message.tps = message.usage.completion_tokens / seconds;
  if (!message.tool_calls.length) delete message.tool_calls;
  if (!message.reasoning) delete message.reasoning;
  running = null;
  if (!current.title) current.title = firstLine(current);
  save();
  renderAll();
}

function send(event) {
  event && event.preventDefault();
  const text = $("input").value;
  if (running || !text.trim()) return;
  if (!current) newConversation();
  current.messages.push({ role: "user", content: text });
  $("input").value = "";
  save();
  generate();
}

function regenerate() {
  if (running || !current) return;
  while (current.messages.length && current.messages[current.messages.length - 1].role === "assistant") current.messages.pop();
  if (!current.messages.length) return;
  generate();
}

function stop() {
  if (running) running.controller.abort();
}

// Settings.

// The loaded plugins of `kind` a request can name (not a refused file, not a built-in a file
// overrides: its name is the file's).
const usable = (kind) => plugins.filter((p) => p.kinds.includes(kind) && p.state !== "refused" && p.state !== "overridden");

const FIELDS = ["system", "temperature", "top_p", "top_k", "min_p", "max_tokens", "seed"];

function renderSettings() {
  const s = current ? current.settings : DEFAULT_SETTINGS;
  for (const f of FIELDS) $(f).value = s[f] ?? "";
  const sampler = $("sampler");
  const samplers = usable("sampler");
  sampler.replaceChildren(new Option("native (the server's default)", ""));
  for (const p of samplers) sampler.append(new Option(`${p.name} ${p.version}`, p.name));
  if (s.sampler && !samplers.some((p) => p.name === s.sampler)) sampler.append(new Option(`${s.sampler} (not loaded)`, s.sampler));
  sampler.value = s.sampler;
  const box = $("stop-rules");
  box.querySelectorAll("label").forEach((l) => l.remove());
  for (const p of usable("stop")) {
    const label = document.createElement("label");
    label.className = "check";
    const input = document.createElement("input");
    input.type = "checkbox";
    input.value = p.name;
    input.checked = s.stop.includes(p.name);
    input.addEventListener("change", () => {
      if (!current) return;
      const set = new Set(current.settings.stop);
      input.checked ? set.add(p.name) : set.delete(p.name);
      current.settings.stop = [...set];
      save();
    });
    label.append(input, " " + p.name);
    box.append(label);
  }
  const kind = $("constraint-kind");
  kind.querySelectorAll("option[data-plugin]").forEach((o) => o.remove());
  for (const p of usable("constraint")) {
    const o = new Option(`plugin: ${p.name} (config as JSON)`, "plugin:" + p.name);
    o.dataset.plugin = p.name;
    kind.append(o);
  }
  kind.value = s.constraintKind;
  $("constraint").value = s.constraint;
  $("constraint").hidden = !s.constraintKind;
}

function showSettings(show) {
  $("settings").hidden = !show;
  $("toggle-settings").setAttribute("aria-expanded", String(show));
}

function bindSettings() {
  const ensure = () => current || (newConversation(), current);
  for (const f of FIELDS) {
    $(f).addEventListener("input", () => {
      ensure().settings[f] = $(f).value;
      save();
    });
  }
  $("sampler").addEventListener("change", () => {
    ensure().settings.sampler = $("sampler").value;
    save();
  });
  $("constraint-kind").addEventListener("change", () => {
    ensure().settings.constraintKind = $("constraint-kind").value;
    $("constraint").hidden = !current.settings.constraintKind;
    save();
  });
  $("constraint").addEventListener("input", () => {
    ensure().settings.constraint = $("constraint").value;
    save();
  });
  $("toggle-settings").addEventListener("click", () => showSettings($("settings").hidden));
}

function exportAll() {
  const blob = new Blob([JSON.stringify({ version: 1, conversations }, null, 2)], { type: "application/json" });
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = "host-conversations.json";
  a.click();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}

async function importFile(file) {
  try {
    const v = JSON.parse(await file.text());
    const list = Array.isArray(v) ? v : v.conversations;
    if (!Array.isArray(list)) throw new Error("no conversations in the file");
    const known = new Set(conversations.map((c) => c.id));
    for (const c of list) {
      if (!c || !Array.isArray(c.messages)) continue;
      c.settings = { ...DEFAULT_SETTINGS, ...(c.settings || {}) };
      if (known.has(c.id)) c.id = c.id + "-" + Date.now();
      conversations.push(c);
    }
    save();
    renderAll();
  } catch (e) {
    alert("Import failed: " + e.message);
  }
}

export function setPlugins(list) {
  plugins = list;
  if (document.activeElement && $("settings").contains(document.activeElement)) return;
  renderSettings();
}

export function start(modelId) {
  model = modelId;
  load();
  if (!current) newConversation();
  $("composer").addEventListener("submit", send);
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) send(e);
  });
  $("stop").addEventListener("click", stop);
  $("regenerate").addEventListener("click", regenerate);
  $("new-chat").addEventListener("click", () => !running && newConversation());
  $("delete-chat").addEventListener("click", () => {
    if (running || !current || !confirm("Delete this conversation?")) return;
    conversations = conversations.filter((c) => c !== current);
    current = conversations[0] || null;
    save();
    if (!current) newConversation();
    else renderAll();
  });
  $("title").addEventListener("change", () => {
    if (!current) return;
    current.title = $("title").value.trim();
    save();
    renderList();
  });
  $("export").addEventListener("click", exportAll);
  $("import").addEventListener("change", (e) => e.target.files[0] && importFile(e.target.files[0]));
  $("messages").addEventListener("click", (e) => {
    const b = e.target.closest("button.copy");
    if (!b) return;
    navigator.clipboard.writeText(b.parentElement.querySelector("code").textContent).then(
      () => (b.textContent = "Copied"),
      () => (b.textContent = "Copy failed"),
    );
  });
  bindSettings();
  renderAll();
}
