// The chat page: conversations kept in the browser's local storage, replies streamed from the
// server's own OpenAI endpoint, and a live view of the prompt cache.

import { renderMarkdown, escapeHtml } from "./markdown.js";
import { renderCache, renderChart } from "./cache-panel.js";

const CHATS_KEY = "mlxkv.chats.v1";
const SETTINGS_KEY = "mlxkv.settings.v1";
const CACHE_POLL_MS = 2000;

const $ = (selector) => document.querySelector(selector);

// ---- state -------------------------------------------------------------------------------

function load(key, fallback) {
  try {
    return JSON.parse(localStorage.getItem(key)) ?? fallback;
  } catch {
    return fallback;
  }
}

const store = load(CHATS_KEY, { chats: [], current: null });
const settings = { temperature: "", maxTokens: "512", apiKey: "", ...load(SETTINGS_KEY, {}) };
let active = null; // the generation running: { chat, message, controller }
let editing = null; // the user message being edited: { chatId, index }
let lastReport = null;

// A reply that was streaming when the page closed ended there.
for (const chat of store.chats) {
  for (const m of chat.messages) {
    if (m.pending) Object.assign(m, { pending: false, stopped: true });
  }
}

function save() {
  // Elements rendered for messages are not data.
  localStorage.setItem(CHATS_KEY, JSON.stringify(store, (key, value) => (key === "el" ? undefined : value)));
  localStorage.setItem(SETTINGS_KEY, JSON.stringify(settings));
}

function newChat() {
  const chat = {
    id: crypto.randomUUID ? crypto.randomUUID() : `${Date.now()}-${Math.random()}`,
    title: "New chat",
    system: "",
    messages: [],
    created: Date.now(),
  };
  store.chats.unshift(chat);
  store.current = chat.id;
  save();
  return chat;
}

const currentChat = () => store.chats.find((c) => c.id === store.current) || null;
// What an entry's label names: a conversation here, or nothing known (the panel says "another
// client"; a conversation deleted here has its entries freed).
const titleOf = (id) => store.chats.find((c) => c.id === id)?.title;

// ---- rendering ---------------------------------------------------------------------------

function renderList() {
  const list = $("#conversations");
  list.innerHTML = "";
  for (const chat of store.chats) {
    const li = document.createElement("li");
    li.className = chat.id === store.current ? "selected" : "";
    li.dataset.id = chat.id;
    li.innerHTML =
      `<button type="button" class="open">${escapeHtml(chat.title)}</button>` +
      `<button type="button" class="delete" aria-label="Delete this conversation" title="Delete">×</button>`;
    li.querySelector(".open").onclick = () => switchTo(chat.id);
    li.querySelector(".delete").onclick = () => deleteChat(chat.id);
    list.appendChild(li);
  }
}

function statsLine(stats) {
  const parts = [
    `<span data-stat="prompt">prompt ${stats.prompt} tokens</span>`,
    `<span data-stat="cached">cached ${stats.cached}</span>`,
  ];
  if (stats.ttft_s != null) parts.push(`<span data-stat="ttft">first token ${stats.ttft_s.toFixed(2)} s</span>`);
  if (stats.tps != null) parts.push(`<span data-stat="tps">${stats.tps.toFixed(1)} tokens/s</span>`);
  return parts.join(" · ");
}

function imagesHtml(images) {
  return (images || []).map((url) => `<img class="thumb" alt="attached image" src="${escapeHtml(url)}">`).join("");
}

const titleFrom = (text) => text.replace(/\s+/g, " ").slice(0, 48);

// The buttons under a message, shown while nothing is generating: Edit on each message the
// user wrote, Retry on the last reply.
function actionsHtml(chat, message, index) {
  if (active || message.pending) return "";
  const last = index === chat.messages.length - 1;
  const button = (name, label) => `<button type="button" class="${name}" title="${label}">${label}</button>`;
  if (message.role === "user") return `<div class="actions">${button("edit", "Edit")}</div>`;
  return last ? `<div class="actions">${button("retry", "Retry")}</div>` : "";
}

function editorHtml(message) {
  return (
    `<div class="editor">${imagesHtml(message.images)}` +
    `<textarea class="edit-input" rows="3" aria-label="Edit the message">${escapeHtml(message.content)}</textarea>` +
    '<div class="actions"><button type="button" class="cancel">Cancel</button>' +
    '<button type="button" class="save primary">Send</button></div></div>'
  );
}

function messageHtml(message, actions = "") {
  if (message.role === "user") return `<div class="bubble">${imagesHtml(message.images)}${escapeHtml(message.content)}</div>${actions}`;
  let html = "";
  // a turn that ended before its first token (refused, unreachable, stopped) has no bubble
  if (message.pending || message.content || message.reasoning) {
    html += '<div class="bubble markdown">';
    if (message.reasoning) {
      // open while the model thinks, folded once the answer comes
      const open = message.pending && !message.content ? " open" : "";
      html += `<details class="thinking"${open}><summary>Thinking</summary><div class="thought">${escapeHtml(message.reasoning)}</div></details>`;
    }
    html += renderMarkdown(message.content);
    if (message.pending && !message.content && !message.reasoning) html += '<span class="typing" aria-label="Waiting for the reply">●●●</span>';
    html += "</div>";
  }
  if (message.error) html += `<div class="error" role="alert">${escapeHtml(message.error)}</div>`;
  const notes = [];
  if (message.stopped) notes.push('<span class="stopped">stopped</span>');
  if (message.stats) notes.push(statsLine(message.stats));
  if (notes.length) html += `<div class="stats">${notes.join(" · ")}</div>`;
  return html + actions;
}

function renderMessage(el, message, actions = "") {
  el.className = `message ${message.role}${message.pending ? " pending" : ""}`;
  el.innerHTML = messageHtml(message, actions);
}

function renderMessages() {
  const chat = currentChat();
  const box = $("#messages");
  box.innerHTML = "";
  $("#chat-title").textContent = chat ? chat.title : "mlxkv";
  $("#system").value = chat ? chat.system : "";
  if (!chat || !chat.messages.length) {
    box.innerHTML = '<div class="empty">Ask anything. Each turn reuses the cache of the turns before it.</div>';
  }
  (chat ? chat.messages : []).forEach((message, index) => {
    const el = document.createElement("div");
    el.dataset.index = index;
    if (editing?.chatId === chat.id && editing.index === index) {
      el.className = "message user editing";
      el.innerHTML = editorHtml(message);
    } else renderMessage(el, message, actionsHtml(chat, message, index));
    message.el = el;
    box.appendChild(el);
  });
  const editor = box.querySelector(".edit-input");
  if (editor) editor.focus();
  else box.scrollTop = box.scrollHeight;
  renderChartForChat();
}

function renderChartForChat() {
  const chat = currentChat();
  const turns = chat ? chat.messages.filter((m) => m.stats).map((m) => m.stats) : [];
  renderChart($("#chart"), turns);
}

function renderComposer() {
  const busy = active !== null;
  $("#send").hidden = busy;
  $("#stop").hidden = !busy;
  $("#send").disabled = busy;
}

function renderAll() {
  renderList();
  renderMessages();
  renderComposer();
}

// ---- actions -----------------------------------------------------------------------------

function switchTo(id) {
  store.current = id;
  save();
  renderAll();
  closeDrawers();
}

async function deleteChat(id) {
  if (active && active.chat.id === id) active.controller.abort();
  store.chats = store.chats.filter((c) => c.id !== id);
  if (store.current === id) store.current = store.chats[0]?.id ?? null;
  save();
  renderAll();
  // No later request will reuse its cache entries: the server frees them (those its
  // prompt_cache_key labels, no other conversation's), then the panel shows what is left.
  try {
    await fetch(`v1/mlxkv/cache/${encodeURIComponent(id)}`, { method: "DELETE", headers: headers() });
  } catch {
    /* the server is gone: it holds nothing to free */
  }
  refreshCache();
}

function headers() {
  const h = { "Content-Type": "application/json" };
  if (settings.apiKey) h.Authorization = `Bearer ${settings.apiKey}`;
  return h;
}

// A user message with pasted or dropped images: OpenAI's image_url parts before the text.
function contentParts(message) {
  const images = message.images.map((url) => ({ type: "image_url", image_url: { url } }));
  return [...images, { type: "text", text: message.content }];
}

// Images pasted or dropped into the composer, as data: URLs, sent with the next message.
let attached = [];

function renderAttached() {
  $("#attachments").innerHTML = imagesHtml(attached);
  $("#attachments").hidden = attached.length === 0;
}

function attach(files) {
  for (const file of files) {
    if (!file.type.startsWith("image/")) continue;
    const reader = new FileReader();
    reader.onload = () => {
      attached.push(reader.result);
      renderAttached();
    };
    reader.readAsDataURL(file);
  }
}

function requestBody(chat) {
  const messages = [];
  if (chat.system.trim()) messages.push({ role: "system", content: chat.system });
  // A turn with no reply is left out whole. Refused before its first token (too long, bad
  // settings, server unreachable): its message sent again would be refused again, every later
  // turn with it. Stopped before its first token: an empty assistant message would be sent.
  const unanswered = (m) => m?.role === "assistant" && !m.content && (m.error || m.stopped);
  chat.messages.forEach((m, i) => {
    if (m.pending || unanswered(m) || (m.role === "user" && unanswered(chat.messages[i + 1]))) return;
    messages.push({ role: m.role, content: m.images?.length ? contentParts(m) : m.content });
  });
  const body = {
    model: "mlxkv",
    messages,
    stream: true,
    stream_options: { include_usage: true },
    prompt_cache_key: chat.id,
  };
  // Sent as typed, so the server (not the page) says what is wrong with a value.
  if (settings.temperature !== "") body.temperature = Number(settings.temperature);
  if (settings.maxTokens !== "") body.max_tokens = Number(settings.maxTokens);
  return body;
}

async function errorMessage(response) {
  let detail = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    detail = body?.error?.message || body?.message || detail;
  } catch {
    /* not JSON: keep the status line */
  }
  if (response.status === 401) {
    $("#settings").open = true;
    return `${detail}. Enter the server's API key in Settings.`;
  }
  return detail;
}

// Reads server-sent events from a fetch response; calls onEvent with each parsed JSON payload.
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart())
        .join("\n");
      if (!data || data === "[DONE]") continue;
      onEvent(JSON.parse(data));
    }
  }
}

async function send(text) {
  const chat = currentChat() || newChat();
  if (chat.title === "New chat") chat.title = titleFrom(text);
  chat.messages.push(attached.length ? { role: "user", content: text, images: attached } : { role: "user", content: text });
  attached = [];
  renderAttached();
  editing = null;
  await reply(chat);
}

// Another reply to the same prompt, in place of the last one: the server has all of that
// prompt in its cache, so the new reply starts at once.
function retry(chat) {
  chat.messages.pop();
  reply(chat);
}

// A user message changed and sent again: the turns after it are dropped (as they answered
// the old text), and the server reuses the conversation's cache up to the change.
function resend(chat, index, text) {
  const message = chat.messages[index];
  if (!text && !message.images?.length) return;
  if (chat.messages.findIndex((m) => m.role === "user") === index && chat.title === titleFrom(message.content)) {
    chat.title = titleFrom(text);
  }
  message.content = text;
  chat.messages.length = index + 1;
  editing = null;
  reply(chat);
}

// Streams the model's reply to the conversation as it stands into a new assistant message.
async function reply(chat) {
  const message = { role: "assistant", content: "", pending: true };
  chat.messages.push(message);
  const controller = new AbortController();
  active = { chat, message, controller };
  save();
  renderAll();
  const update = () => {
    if (message.el && chat.id === store.current) {
      renderMessage(message.el, message);
      const box = $("#messages");
      box.scrollTop = box.scrollHeight;
    }
  };
  const start = performance.now();
  let firstAt = null;
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST",
      headers: headers(),
      body: JSON.stringify(requestBody(chat)),
      signal: controller.signal,
    });
    if (!response.ok) {
      message.error = await errorMessage(response);
      return;
    }
    await readEvents(response, (event) => {
      if (event.error) {
        message.error = event.error.message || "the generation failed";
        return;
      }
      const delta = event.choices?.[0]?.delta;
      if (delta?.content || delta?.reasoning_content) {
        firstAt = firstAt ?? performance.now();
        message.content += delta.content || "";
        if (delta.reasoning_content) message.reasoning = (message.reasoning || "") + delta.reasoning_content;
        update();
      }
      if (event.usage) {
        const done = performance.now();
        const generated = event.usage.completion_tokens;
        message.stats = {
          prompt: event.usage.prompt_tokens,
          cached: event.usage.prompt_tokens_details?.cached_tokens ?? 0,
          completion: generated,
          ttft_s: firstAt === null ? null : (firstAt - start) / 1000,
          tps: firstAt !== null && generated > 1 ? (generated - 1) / ((done - firstAt) / 1000) : null,
        };
      }
    });
  } catch (error) {
    if (error.name === "AbortError") message.stopped = true;
    else message.error = `Could not reach the server (${error.message}). Is mlxkv serve running?`;
  } finally {
    message.pending = false;
    delete message.el;
    active = null;
    save();
    renderAll();
    refreshCache();
    $("#input").focus();
  }
}

function stop() {
  if (active) active.controller.abort();
}

// ---- cache panel -------------------------------------------------------------------------

async function refreshCache() {
  try {
    const response = await fetch("v1/mlxkv/cache", { headers: headers() });
    lastReport = response.ok ? await response.json() : null;
  } catch {
    lastReport = null;
  }
  renderCache($("#cache-panel"), lastReport, titleOf);
}

function pollCache() {
  if (document.visibilityState === "visible" && !$("#cache-panel").hidden) refreshCache();
  setTimeout(pollCache, CACHE_POLL_MS);
}

// ---- wiring ------------------------------------------------------------------------------

// Edit, Send, Cancel and Retry under a message of the current conversation.
function messageAction(button) {
  const chat = currentChat();
  const index = Number(button.closest(".message")?.dataset.index);
  if (!chat || active || !(index in chat.messages)) return;
  const last = index === chat.messages.length - 1;
  if (button.classList.contains("retry") && last && chat.messages[index].role === "assistant") retry(chat);
  else if (button.classList.contains("edit")) editing = { chatId: chat.id, index };
  else if (button.classList.contains("cancel")) editing = null;
  else if (button.classList.contains("save")) {
    resend(chat, index, button.closest(".editor").querySelector(".edit-input").value.trim());
    return;
  } else return;
  renderAll();
}

function closeDrawers() {
  document.body.classList.remove("show-sidebar");
}

function wire() {
  $("#composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("#input").value.trim();
    if ((!text && !attached.length) || active) return;
    $("#input").value = "";
    send(text);
  });
  $("#input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("#composer").requestSubmit();
    }
  });
  $("#input").addEventListener("paste", (event) => {
    const files = [...(event.clipboardData?.files || [])];
    if (files.some((f) => f.type.startsWith("image/"))) {
      event.preventDefault();
      attach(files);
    }
  });
  $("#composer").addEventListener("dragover", (event) => event.preventDefault());
  $("#composer").addEventListener("drop", (event) => {
    event.preventDefault();
    attach([...(event.dataTransfer?.files || [])]);
  });
  $("#stop").onclick = stop;
  $("#new-chat").onclick = () => {
    newChat();
    renderAll();
    closeDrawers();
    $("#input").focus();
  };
  $("#menu").onclick = () => document.body.classList.toggle("show-sidebar");
  $("#toggle-cache").onclick = () => {
    const panel = $("#cache-panel");
    panel.hidden = !panel.hidden;
    $("#toggle-cache").setAttribute("aria-expanded", String(!panel.hidden));
    if (!panel.hidden) refreshCache();
  };
  $("#system").addEventListener("input", (event) => {
    const chat = currentChat() || newChat();
    chat.system = event.target.value;
    save();
  });
  for (const [id, key] of [["#temperature", "temperature"], ["#max-tokens", "maxTokens"], ["#api-key", "apiKey"]]) {
    $(id).value = settings[key];
    $(id).addEventListener("input", (event) => {
      settings[key] = event.target.value.trim();
      save();
    });
  }
  $("#messages").addEventListener("click", (event) => {
    const button = event.target.closest("button");
    if (button && !button.classList.contains("copy")) messageAction(button);
  });
  $("#messages").addEventListener("keydown", (event) => {
    if (!event.target.classList.contains("edit-input")) return;
    if (event.key === "Escape") messageAction(event.target.parentElement.querySelector(".cancel"));
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      messageAction(event.target.parentElement.querySelector(".save"));
    }
  });
  // Copy buttons of code blocks (rendered inside replies).
  $("#messages").addEventListener("click", (event) => {
    const button = event.target.closest("button.copy");
    if (!button) return;
    const code = button.parentElement.querySelector("code").textContent;
    navigator.clipboard?.writeText(code).then(() => {
      button.textContent = "Copied";
      setTimeout(() => (button.textContent = "Copy"), 1500);
    });
  });
  if (window.matchMedia("(max-width: 720px)").matches) $("#cache-panel").hidden = true;
}

wire();
renderAll();
pollCache();
