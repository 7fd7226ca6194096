// The llmkit playground: a chat over the server's own OpenAI routes, streamed with fetch.
// No dependencies and nothing fetched from elsewhere, so it works offline.

const $ = (id) => document.getElementById(id);
const config = JSON.parse($("llmkit-config")?.textContent || "{}");
const KEY = "llmkit-api-key";
const history = []; // {role, content, tool_calls?} sent with every request
let model = null;
let controller = null; // the AbortController of the answer being streamed

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(KEY);
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

function askKey(refused) {
  $("key-error").hidden = !refused;
  $("api-key").value = "";
  if (!$("key-dialog").open) $("key-dialog").showModal();
}

async function loadModel() {
  const r = await fetch("/v1/models", { headers: headers() });
  if (r.status === 401) return askKey(Boolean(sessionStorage.getItem(KEY)));
  const data = await r.json();
  model = data.data[0].id;
  $("model-name").textContent = model;
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text; // never innerHTML: model output is text
  return e;
}

function addMessage(role, text) {
  const box = el("div", `msg ${role}`);
  box.append(el("div", "role", role));
  const content = el("div", "content", text || "");
  box.append(content);
  $("messages").append(box);
  box.scrollIntoView({ block: "end" });
  return { box, content };
}

function samplingBody() {
  const body = { temperature: Number($("temperature").value), top_p: Number($("top-p").value) };
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (maxTokens > 0) body.max_tokens = maxTokens;
  const seed = $("seed").value.trim();
  if (seed !== "") body.seed = parseInt(seed, 10);
  if (!$("thinking").checked) body.chat_template_kwargs = { enable_thinking: false };
  $("schema-error").hidden = true;
  try {
    const schema = $("schema").value.trim();
    if (schema) body.response_format = { type: "json_schema", json_schema: { name: "output", schema: JSON.parse(schema) } };
    const tools = $("tools").value.trim();
    if (tools) {
      body.tools = JSON.parse(tools);
      if ($("tool-required").checked) body.tool_choice = "required";
    }
  } catch (e) {
    $("schema-error").textContent = `Invalid JSON: ${e.message}`;
    $("schema-error").hidden = false;
    return null;
  }
  return body;
}

// One streamed answer: reasoning in a <details> that is open while it streams and collapses when
// the answer starts (or the response ends), tool calls as such, and the speed underneath.
class Answer {
  constructor() {
    const { box, content } = addMessage("assistant", "");
    this.box = box;
    this.content = content;
    this.text = "";
    this.reasoning = null;
    this.calls = [];
    this.t0 = performance.now();
    this.tFirst = null;
    this.chunks = 0;
    this.usage = null;
  }

  reasoningBlock() {
    if (!this.reasoning) {
      const d = el("details", "reasoning");
      d.open = true;
      d.append(el("summary", null, "Reasoning"));
      const t = el("div", "reasoning-text");
      d.append(t);
      this.box.insertBefore(d, this.content);
      this.reasoning = { details: d, text: t };
    }
    return this.reasoning;
  }

  delta(d) {
    if (d.content || d.reasoning_content || d.tool_calls) {
      if (this.tFirst === null) this.tFirst = performance.now();
      this.chunks += 1;
    }
    if (d.reasoning_content) this.reasoningBlock().text.textContent += d.reasoning_content;
    if (d.content) {
      if (this.reasoning) this.reasoning.details.open = false;
      this.text += d.content;
      this.content.textContent = this.text.replace(/^\s+/, ""); // a template's leading newlines
    }
    for (const tc of d.tool_calls || []) {
      let call = this.calls[tc.index];
      if (!call) {
        call = this.calls[tc.index] = { id: tc.id, name: "", args: "", node: el("div", "tool-call") };
        this.box.insertBefore(call.node, this.content.nextSibling);
      }
      if (tc.function?.name) call.name += tc.function.name;
      if (tc.function?.arguments) call.args += tc.function.arguments;
      call.node.textContent = `tool call: ${call.name}(${call.args})`;
    }
    this.box.scrollIntoView({ block: "end" });
  }

  finish(note) {
    if (this.reasoning) this.reasoning.details.open = false;
    const end = performance.now();
    const parts = [];
    const tokens = this.usage ? this.usage.completion_tokens : this.chunks;
    if (this.tFirst !== null) {
      parts.push(`${tokens} tokens`);
      if (tokens > 1 && end > this.tFirst) parts.push(`${((tokens - 1) / ((end - this.tFirst) / 1000)).toFixed(1)} tok/s`);
      parts.push(`TTFT ${Math.round(this.tFirst - this.t0)} ms`);
    }
    if (note) parts.push(note);
    this.box.append(el("div", "stats", parts.join(" · ")));
    this.box.scrollIntoView({ block: "end" });
  }

  error(message) {
    this.box.append(el("div", "error", message));
  }

  message() {
    const m = { role: "assistant", content: this.text };
    const calls = this.calls.filter(Boolean);
    if (calls.length) {
      m.tool_calls = calls.map((c) => ({ id: c.id, type: "function", function: { name: c.name, arguments: c.args } }));
    }
    return m;
  }
}

async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, i);
      buf = buf.slice(i + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("prompt").disabled = busy;
}

async function send(text) {
  const sampling = samplingBody();
  if (sampling === null) return;
  addMessage("user", text);
  history.push({ role: "user", content: text });
  const system = $("system").value.trim();
  const messages = system ? [{ role: "system", content: system }, ...history] : [...history];
  const answer = new Answer();
  controller = new AbortController();
  setBusy(true);
  let note = "";
  let accepted = false;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), signal: controller.signal,
      body: JSON.stringify({ model: model || "default", messages, stream: true,
                             stream_options: { include_usage: true }, ...sampling }),
    });
    if (!r.ok) {
      const err = await r.json().catch(() => ({}));
      answer.error(`HTTP ${r.status}: ${err.error?.message || r.statusText}`);
      if (r.status === 401) askKey(true);
      history.pop();
      return;
    }
    accepted = true;
    for await (const ev of events(r)) {
      if (ev.error) { answer.error(ev.error.message || JSON.stringify(ev.error)); break; }
      if (ev.usage) answer.usage = ev.usage;
      for (const c of ev.choices || []) {
        answer.delta(c.delta || {});
        if (c.finish_reason && !["stop", "tool_calls"].includes(c.finish_reason)) note = `finish: ${c.finish_reason}`;
      }
    }
  } catch (e) {
    if (e.name === "AbortError") note = "stopped";
    else answer.error(String(e));
  } finally {
    controller = null;
    answer.finish(note);
    if (accepted) history.push(answer.message());
    setBusy(false);
    $("prompt").focus();
  }
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
});
$("stop").addEventListener("click", () => controller?.abort()); // closing the stream aborts the request
$("new-chat").addEventListener("click", () => {
  controller?.abort();
  history.length = 0;
  $("messages").replaceChildren();
});
for (const [input, out] of [["temperature", "temperature-value"], ["top-p", "top-p-value"]]) {
  $(input).addEventListener("input", () => { $(out).textContent = $(input).value; });
}
$("api-key-form").addEventListener("submit", () => {
  sessionStorage.setItem(KEY, $("api-key").value);
  loadModel();
});
if (config.auth) $("change-key").hidden = false;
$("change-key").addEventListener("click", () => askKey(false));

if (config.auth && !sessionStorage.getItem(KEY)) askKey(false);
else loadModel();
