// Spool's chat page: one WebSocket (/v1/ws) carries every generation, each cancellable on its
// own; /v1/models says whether a key is needed, /metrics feeds the header. Model output is only
// ever set as textContent, so nothing it writes becomes markup.
"use strict";

const $ = (id) => document.getElementById(id);
const state = {
  key: localStorage.getItem("spool-api-key") || "",
  socket: null,
  turns: [],  // {user, answers: [gen], kept: gen}
  pending: new Map(),  // generation id -> gen
  seq: 0,
  retries: 0,
  timer: null,
};

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function banner(text) {
  $("banner").textContent = text || "";
  $("banner").hidden = !text;
}

function setStatus(text, ok) {
  $("status").textContent = text;
  $("status").classList.toggle("ok", Boolean(ok));
}

function number(id) {
  return Number($(id).value);
}

// --- the server: key, model, metrics ---------------------------------------------------------

function authHeaders() {
  return state.key ? { Authorization: `Bearer ${state.key}` } : {};
}

async function describe(response) {
  try {
    const body = await response.json();
    return `${response.status}: ${body.error.message}`;
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

async function api(path) {
  let response;
  try {
    response = await fetch(path, { headers: authHeaders() });
  } catch {
    throw new Error("the server is unreachable");
  }
  if (response.status === 401) {
    askKey(state.key ? "That key was refused." : "");
    throw new Error("this server needs an API key");
  }
  if (!response.ok) throw new Error(await describe(response));
  return response;
}

function askKey(hint) {
  $("keyform").hidden = false;
  $("keyhint").textContent = hint;
  $("key").focus();
}

$("keyform").addEventListener("submit", (event) => {
  event.preventDefault();
  state.key = $("key").value.trim();
  localStorage.setItem("spool-api-key", state.key);
  $("keyform").hidden = true;
  start();
});

function metric(text, name) {
  const match = text.match(new RegExp(`^${name}(?:\\{[^}]*\\})? (\\S+)$`, "m"));
  return match ? Number(match[1]) : "?";
}

function label(text, name) {
  const match = text.match(new RegExp(`${name}="([^"]*)"`));
  return match ? match[1] : "";
}

async function refreshHeader() {
  try {
    const text = await (await api("/metrics")).text();
    const info = (text.match(/^spool:server_info\{([^}]*)\}/m) || [])[1] || "";
    $("model").textContent = label(info, "model_name") || $("model").textContent;
    $("backend").textContent = label(info, "backend");
    $("load").textContent = `running ${metric(text, "spool:num_requests_running")}`
      + ` · waiting ${metric(text, "spool:num_requests_waiting")}`;
  } catch (error) {
    $("load").textContent = `metrics: ${error.message}`;
  }
}

// --- the socket ------------------------------------------------------------------------------

function base64url(text) {
  const bytes = new TextEncoder().encode(text);
  return btoa(String.fromCharCode(...bytes)).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

function retryLater(why) {
  banner(`${why}; trying again…`);
  setStatus("offline", false);
  clearTimeout(state.timer);
  state.timer = setTimeout(start, Math.min(10000, 500 * 2 ** state.retries++));
}

async function start() {
  clearTimeout(state.timer);
  try {
    const models = await (await api("/v1/models")).json();
    $("model").textContent = models.data[0].id;
  } catch (error) {
    if ($("keyform").hidden) retryLater(error.message);
    else banner(error.message);
    return;
  }
  banner("");
  connect();
  refreshHeader();
}

function connect() {
  const url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/v1/ws`;
  const protocols = ["spool"];
  if (state.key) protocols.push(`spool.bearer.${base64url(state.key)}`);
  const socket = new WebSocket(url, protocols);
  state.socket = socket;
  socket.onopen = () => {
    state.retries = 0;
    setStatus("connected", true);
  };
  socket.onmessage = (event) => onFrame(JSON.parse(event.data));
  socket.onclose = () => {
    if (state.socket !== socket) return;
    state.socket = null;
    for (const gen of state.pending.values()) finish(gen, "dropped", null, "the connection dropped");
    retryLater("the connection to the server dropped");
  };
}

function onFrame(frame) {
  const gen = state.pending.get(frame.id);
  if (!gen) {
    if (frame.type === "error") banner(frame.error.message);
    return;
  }
  if (frame.type === "delta") {
    gen.first = gen.first || performance.now();
    gen.pieces += 1;
    gen.text.textContent += frame.text;
    showStats(gen);
    gen.box.scrollIntoView({ block: "end" });
  } else if (frame.type === "done") {
    const choice = frame.choices[0];
    finish(gen, gen.stopped ? "stopped" : choice.finish_reason, frame.usage, choice.error);
  } else if (frame.type === "error") {
    finish(gen, "error", null, frame.error.message);
  }
}

// --- generations -----------------------------------------------------------------------------

function history() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  for (const turn of state.turns) {
    messages.push({ role: "user", content: turn.user });
    const answer = turn.kept && turn.kept.text.textContent;
    if (answer) messages.push({ role: "assistant", content: answer });
  }
  return messages;
}

function send(compare) {
  const text = $("prompt").value.trim();
  if (!text) return;
  if (!state.socket || state.socket.readyState !== WebSocket.OPEN) {
    banner("not connected to the server yet");
    return;
  }
  $("prompt").value = "";
  const turn = { user: text, answers: [], kept: null };
  $("messages").append(el("div", "user", text));
  const row = el("div", compare ? "answers compare" : "answers");
  $("messages").append(row);
  const messages = [...history(), { role: "user", content: text }];
  const temperatures = compare ? [number("compare_a"), number("compare_b")] : [number("temperature")];
  turn.answers = temperatures.map((temperature) => generate(row, turn, messages, temperature, compare));
  turn.kept = turn.answers[0];
  state.turns.push(turn);
}

function generate(row, turn, messages, temperature, compare) {
  const id = `g${++state.seq}`;
  const gen = {
    id, box: el("div", "answer running"), text: el("div", "text"), stats: el("div", "stats"),
    started: performance.now(), first: 0, pieces: 0, stopped: false,
  };
  const stop = el("button", "stop", "Stop");
  stop.onclick = () => {
    gen.stopped = true;
    stop.disabled = true;
    if (state.socket) state.socket.send(JSON.stringify({ type: "cancel", id }));
  };
  const controls = el("div", "controls");
  controls.append(stop);
  if (compare) {
    gen.box.prepend(el("div", "setting", `temperature ${temperature}`));
    const keep = el("button", "keep", "Continue with this one");
    keep.onclick = () => {
      turn.kept = gen;
      for (const other of turn.answers) other.box.classList.toggle("kept", other === gen);
    };
    controls.append(keep);
  }
  gen.box.append(gen.text, gen.stats, controls);
  gen.stopButton = stop;
  row.append(gen.box);
  state.pending.set(id, gen);
  state.socket.send(JSON.stringify({
    type: "generate", id, messages, temperature, top_p: number("top_p"), max_tokens: number("max_tokens"),
  }));
  return gen;
}

function showStats(gen, usage, reason) {
  const now = performance.now();
  const tokens = usage ? usage.completion_tokens : gen.pieces;
  const parts = [];
  if (gen.first) parts.push(`first token ${Math.round(gen.first - gen.started)} ms`);
  if (gen.first && now > gen.first && tokens > 1) {
    parts.push(`${((tokens - 1) / ((now - gen.first) / 1000)).toFixed(1)} tok/s`);
  }
  parts.push(`${tokens} tokens`);
  if (usage) parts.push(`${(usage.prompt_tokens_details || {}).cached_tokens || 0} prompt tokens cached`);
  if (reason) parts.push(reason);
  gen.stats.textContent = parts.join(" · ");
}

function finish(gen, reason, usage, error) {
  state.pending.delete(gen.id);
  gen.box.classList.remove("running");
  gen.box.classList.add(reason === "stopped" ? "stopped" : reason === "error" || error ? "failed" : "done");
  gen.stopButton.hidden = true;
  if (error) gen.box.append(el("div", "error", error));
  showStats(gen, usage, reason);
  refreshHeader();
}

// --- the page --------------------------------------------------------------------------------

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  send(false);
});
$("compare").addEventListener("click", () => send(true));
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    send(false);
  }
});
$("clear").addEventListener("click", () => {
  for (const gen of state.pending.values()) gen.stopButton.click();
  state.turns = [];
  $("messages").replaceChildren();
});

setInterval(() => {
  if (state.socket) refreshHeader();
}, 3000);
start();
