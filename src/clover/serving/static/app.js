// Clover's web page: a chat that streams from /v1/chat/completions and draws the diffusion.
// The request asks for `clover_commits`, so besides the final text (delta.content) each chunk
// may carry the tokens committed at a denoising step: [answer index, token text, step].
// Blocks are drawn as rows of masked cells that fill in, coloured by the step (counted from
// the block's first step) that committed each one. No framework and no build step.
"use strict";

const $ = (id) => document.getElementById(id);
const STEP_COLOURS = 8;
const conversation = [];
let modelId = null;

function authHeaders() {
  const key = $("api_key").value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function checkHealth() {
  const dot = $("status");
  try {
    const res = await fetch("/health");
    const body = await res.json();
    // the model's name first: the dot turns ready once the page can send to it
    if (res.ok && !modelId) await loadModel();
    dot.className = "dot " + (res.ok ? "ready" : "busy");
    dot.title = body.status;
  } catch {
    dot.className = "dot down";
    dot.title = "unreachable";
  }
}

async function loadModel() {
  const res = await fetch("/v1/models", { headers: authHeaders() });
  if (!res.ok) {
    $("model").textContent = res.status === 401 ? "API key needed (Settings)" : "model unavailable";
    return;
  }
  const body = await res.json();
  modelId = body.data[0].id;
  $("model").textContent = `${modelId} · context ${body.data[0].max_model_len}`;
}

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function visible(token) {
  // whitespace tokens would be invisible cells
  return token.replace(/\n/g, "↵").replace(/\t/g, "⇥").replace(/^ +$/, (s) => "␣".repeat(s.length));
}

// One assistant answer: its text, its reasoning and its diffusion view.
class AnswerView {
  constructor(log) {
    this.card = element("div", "msg assistant");
    this.reasoningBox = element("details", "reasoning");
    this.reasoningBox.open = true;
    this.reasoningBox.append(element("summary", "", "Thinking"));
    this.reasoningText = element("div", "text");
    this.reasoningBox.append(this.reasoningText);
    this.reasoningBox.hidden = true;
    this.answer = element("div", "answer");
    this.diffusion = element("div", "diffusion");
    this.stats = element("div", "stats", "waiting…");
    this.card.append(this.reasoningBox, this.answer, this.diffusion, this.stats);
    log.append(this.card);
    this.blockSize = 1;
    this.blocks = new Map(); // block number -> {cells, firstStep}
    this.content = "";
  }

  start(info) {
    this.blockSize = info.block_size || 1;
    this.decoder = info.decoder;
    this.diffusion.classList.toggle("flow", this.blockSize === 1);
  }

  commit(index, token, step) {
    const number = Math.floor(index / this.blockSize);
    let block = this.blocks.get(number);
    if (!block) {
      const row = element("div", "block");
      const cells = [];
      for (let i = 0; i < this.blockSize; i++) {
        const cell = element("span", "cell mask", "·");
        row.append(cell);
        cells.push(cell);
      }
      block = { cells, firstStep: step };
      this.blocks.set(number, block);
      this.diffusion.append(row);
    }
    const cell = block.cells[index % this.blockSize];
    const colour = Math.min(step - block.firstStep, STEP_COLOURS - 1);
    cell.className = `cell s${colour}`;
    cell.textContent = visible(token);
    cell.title = `token ${index}, step ${step - block.firstStep + 1} of its block`;
  }

  text(delta) {
    if (delta.reasoning_content) {
      this.reasoningBox.hidden = false;
      this.reasoningText.textContent += delta.reasoning_content;
    }
    if (delta.content) {
      this.content += delta.content;
      this.answer.textContent = this.content;
    }
  }

  finish(timings, reason) {
    // positions past the end of the answer (after EOS) were decoded but are not part of it
    for (const [number, block] of this.blocks) {
      block.cells.forEach((cell, i) => {
        const index = number * this.blockSize + i;
        if (index >= timings.completion_tokens) cell.classList.add("beyond");
      });
    }
    const tokensPerS = timings.tokens_per_s.toFixed(1);
    this.stats.textContent =
      `${timings.completion_tokens} tokens · NFE ${timings.nfe} · TPF ${timings.tpf.toFixed(2)}` +
      ` · ${tokensPerS} tokens/s · ${this.decoder}, block ${this.blockSize} · ${reason}`;
    const legend = element("span", "legend", "steps:");
    for (let s = 0; s < STEP_COLOURS; s++) legend.append(element("span", `cell s${s}`, String(s + 1)));
    this.stats.append(legend);
  }

  fail(message) {
    this.stats.textContent = "";
    this.card.append(element("div", "error", message));
  }
}

function requestBody(messages) {
  const body = { messages, stream: true, clover_commits: true };
  if (modelId) body.model = modelId;
  const number = (id) => ($(id).value === "" ? undefined : Number($(id).value));
  for (const id of ["block_size", "threshold", "max_tokens", "temperature"]) {
    if (number(id) !== undefined) body[id] = number(id);
  }
  if ($("decoder").value) body.decoder = $("decoder").value;
  if ($("thinking").checked) body.chat_template_kwargs = { enable_thinking: true };
  return body;
}

// Read a server-sent-event stream, calling onEvent with each parsed `data:` payload.
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}

async function send(prompt) {
  const log = $("log");
  log.append(element("div", "msg user", prompt));
  conversation.push({ role: "user", content: prompt });
  const view = new AnswerView(log);
  log.scrollTop = log.scrollHeight;
  $("send").disabled = true;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify(requestBody(conversation)),
    });
    if (!response.ok) {
      const body = await response.json().catch(() => ({}));
      throw new Error(body.error ? body.error.message : `HTTP ${response.status}`);
    }
    await readEvents(response, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.clover && chunk.clover.block_size) view.start(chunk.clover);
      if (chunk.clover && chunk.clover.commits) {
        for (const [index, token, step] of chunk.clover.commits) view.commit(index, token, step);
      }
      const choice = chunk.choices[0];
      if (!choice) return;
      view.text(choice.delta || {});
      if (choice.finish_reason) view.finish(chunk.timings, choice.finish_reason);
      log.scrollTop = log.scrollHeight;
    });
    conversation.push({ role: "assistant", content: view.content });
  } catch (error) {
    conversation.pop();
    view.fail(String(error.message || error));
  } finally {
    $("send").disabled = false;
  }
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const prompt = $("prompt").value.trim();
  if (!prompt || $("send").disabled) return;
  $("prompt").value = "";
  send(prompt);
});

$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});

$("clear").addEventListener("click", () => {
  conversation.length = 0;
  for (const node of [...$("log").querySelectorAll(".msg")]) node.remove();
});

$("api_key").value = localStorage.getItem("clover_api_key") || "";
$("api_key").addEventListener("change", () => {
  localStorage.setItem("clover_api_key", $("api_key").value.trim());
  modelId = null;
  checkHealth();
});

checkHealth();
setInterval(checkHealth, 5000);
