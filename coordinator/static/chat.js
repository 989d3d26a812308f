"use strict";
// The coordinator's chat page: streams from this coordinator's own /v1/chat/completions (SSE), shows each
// reply's tokens/s and where its experts ran (the change of /dispatch's per-layer rows while it streamed:
// computed here, or on volunteers), and stops a reply by aborting its request (the coordinator cancels a
// request whose client went away, which frees its slot). Text from the model is only ever set as text.

const $ = (id) => document.getElementById(id);
const state = { model: "", messages: [], controller: null };

function fmt(n) { return Math.round(n).toLocaleString("en-US"); }

async function getJSON(path) {
  const r = await fetch(path, { cache: "no-store" });
  if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
  return r.json();
}

async function refreshModel() {
  try {
    const j = await getJSON("/v1/models");
    state.model = j.data[0].id;
    $("model").textContent = state.model;
  } catch (e) {
    $("model").textContent = "model unknown (" + e.message + ")";
  }
}

async function refreshHealth() {
  try {
    const h = await getJSON("/health");
    const parts = [`${h.slots_processing} of ${h.slots_idle + h.slots_processing} slots busy`];
    if (h.status && h.status !== "ok") parts.push(h.status + (h.reason ? ": " + h.reason : ""));
    if (h.market) parts.push(h.market.registered ? "registered with its market" : "market: " + (h.market.last_error || "not registered yet"));
    if (h.coverage_holes) parts.push(`${h.coverage_holes} expert ranges without a volunteer`);
    $("health").textContent = parts.join(" · ");
  } catch (e) {
    $("health").textContent = "health unknown (" + e.message + ")";
  }
}

// Expert rows computed so far: here (the coordinator's own kernels, fallbacks included) and on volunteers.
async function dispatchRows() {
  try {
    const d = await getJSON("/dispatch");
    let local = 0, remote = 0;
    for (const L of d.layers) { local += L.local_rows + L.fallback_rows; remote += L.remote_rows; }
    const calls = {};
    for (const w of d.workers) calls[w.peer_id] = w.calls;
    return { local, remote, calls };
  } catch (e) {
    return null;
  }
}

function expertsText(before, now, el) {
  if (!before || !now) return "experts: not known (no /dispatch)";
  const local = Math.max(0, now.local - before.local), remote = Math.max(0, now.remote - before.remote);
  const used = Object.keys(now.calls).filter((p) => now.calls[p] > (before.calls[p] || 0)).length;
  el.dataset.localRows = local;
  el.dataset.remoteRows = remote;
  el.dataset.volunteers = used;
  const all = local + remote;
  if (all === 0) return "experts: none computed yet";
  if (remote === 0) return `experts: all here on the coordinator (${fmt(local)} rows)`;
  const pct = Math.round((100 * remote) / all);
  return `experts: ${pct}% on ${used} volunteer${used === 1 ? "" : "s"} (${fmt(remote)} rows), ${100 - pct}% here (${fmt(local)} rows)`;
}

function addMessage(role, text) {
  $("empty").hidden = true;
  const el = document.createElement("div");
  el.className = "msg " + role;
  const t = document.createElement("pre");
  t.className = "text";
  t.textContent = text;
  el.appendChild(t);
  if (role === "assistant") {
    const s = document.createElement("div");
    s.className = "stats";
    for (const k of ["speed", "end", "experts"]) {
      const span = document.createElement("span");
      span.className = k;
      s.appendChild(span);
      s.appendChild(document.createTextNode(" "));
    }
    el.appendChild(s);
  }
  $("log").appendChild(el);
  el.scrollIntoView({ block: "end" });
  return el;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function send() {
  const text = $("input").value.trim();
  if (!text || state.controller) return;
  $("input").value = "";
  state.messages.push({ role: "user", content: text });
  addMessage("user", text);
  const el = addMessage("assistant", "");
  const textEl = el.querySelector(".text"), speedEl = el.querySelector(".speed");
  const endEl = el.querySelector(".end"), expertsEl = el.querySelector(".experts");
  el.dataset.finish = "streaming";
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  const system = $("system").value.trim();
  const body = {
    model: state.model,
    messages: (system ? [{ role: "system", content: system }] : []).concat(state.messages),
    stream: true,
    stream_options: { include_usage: true },
    return_token_ids: true,
    max_tokens: Math.max(1, parseInt($("max-tokens").value, 10) || 512),
    temperature: Math.min(2, Math.max(0, parseFloat($("temperature").value) || 0)),
    skip_special_tokens: !$("show-special").checked,
  };
  const before = await dispatchRows();
  const t0 = performance.now();
  let first = null, last = null, tokens = 0, content = "", finish = null, error = null;
  const showSpeed = () => {
    el.dataset.tokens = tokens;
    if (first === null) { speedEl.textContent = "waiting for the first token…"; return; }
    const decode = last > first && tokens > 1 ? ((tokens - 1) * 1000) / (last - first) : 0;
    el.dataset.tps = decode.toFixed(2);
    speedEl.textContent = `${tokens} tokens · ${decode.toFixed(1)} tokens/s · first token after ${fmt(first - t0)} ms`;
  };
  const showExperts = async () => { expertsEl.textContent = expertsText(before, await dispatchRows(), el); };
  showSpeed();
  const poll = setInterval(showExperts, 1000);
  const onEvent = (raw) => {
    for (const line of raw.split("\n")) {
      if (!line.startsWith("data: ")) continue;
      const data = line.slice(6);
      if (data === "[DONE]") return;
      const j = JSON.parse(data);
      if (j.error) { error = j.error.message || "error"; continue; }
      for (const ch of j.choices || []) {
        const n = (ch.token_ids || []).length;
        if (n) {
          last = performance.now();
          if (first === null) first = last;
          tokens += n;
        }
        if (ch.delta && ch.delta.content) { content += ch.delta.content; textEl.textContent = content; }
        if (ch.finish_reason) finish = ch.finish_reason;
      }
      if (j.usage) tokens = j.usage.completion_tokens;
    }
    showSpeed();
  };
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body), signal: controller.signal,
    });
    if (!r.ok) {
      let msg = `HTTP ${r.status}`;
      try { msg = (await r.json()).error.message; } catch (e) { /* not JSON */ }
      throw new Error(msg);
    }
    const reader = r.body.getReader(), dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) { onEvent(buf.slice(0, i)); buf = buf.slice(i + 2); }
      el.scrollIntoView({ block: "end" });
    }
  } catch (e) {
    if (e.name === "AbortError") finish = "stopped"; else error = e.message;
  } finally {
    clearInterval(poll);
    state.controller = null;
    setBusy(false);
  }
  if (error !== null) finish = "error";
  el.dataset.finish = finish || "error";
  endEl.textContent = {
    stop: "· done", length: "· cut at max tokens", stopped: "· stopped", error: "· failed: " + (error || "the stream ended early"),
  }[el.dataset.finish] || "";
  showSpeed();
  await showExperts();
  if (content) state.messages.push({ role: "assistant", content });
  $("input").focus();
}

function stop() {
  if (state.controller) state.controller.abort();
}

function clear() {
  if (state.controller) return;
  state.messages = [];
  for (const el of [...document.querySelectorAll(".msg")]) el.remove();
  $("empty").hidden = false;
}

$("send").addEventListener("click", send);
$("stop").addEventListener("click", stop);
$("clear").addEventListener("click", clear);
$("input").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); send(); }
});
refreshModel();
refreshHealth();
setInterval(refreshHealth, 5000);
$("input").focus();
