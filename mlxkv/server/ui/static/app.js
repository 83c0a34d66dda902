// The chat page: conversations kept in the browser's local storage, each with the served model
// it talks to; replies streamed from the server's own OpenAI endpoint; a live view of the cache.

import { escapeHtml } from "./markdown.js";
import { actionsHtml, editorHtml, imagesHtml, messageHtml } from "./messages.js";
import { errorDetail, readEvents } from "./stream.js";
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
const settings = { temperature: "", maxTokens: "512", apiKey: "", model: "", ...load(SETTINGS_KEY, {}) };
// The chat models the server serves (GET v1/models, embedding models left out), the default
// first; empty until known, when requests name no model and the server answers with its default.
let models = [];
let active = null; // the generation running: { chat, message, controller }
let editing = null; // the user message being edited: { chatId, index, draft }
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
    model: settings.model,
    messages: [],
    created: Date.now(),
  };
  store.chats.unshift(chat);
  store.current = chat.id;
  save();
  return chat;
}

const currentChat = () => store.chats.find((c) => c.id === store.current) || null;
// The served model a conversation talks to: the one chosen for it while the server serves it,
// else the server's default.
const modelOf = (chat) => (models.includes(chat?.model) ? chat.model : models[0]);
// `path` asked of the model the current conversation talks to (the server's default without one).
const forModel = (path, chat = currentChat()) => (modelOf(chat) ? `${path}?model=${encodeURIComponent(modelOf(chat))}` : path);
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

const titleFrom = (text) => text.replace(/\s+/g, " ").slice(0, 48);

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
      el.innerHTML = editorHtml(message, editing.draft);
    } else renderMessage(el, message, actionsHtml(message, { busy: active !== null, last: index === chat.messages.length - 1 }));
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

function renderModels() {
  const select = $("#model");
  select.hidden = models.length < 2;
  select.innerHTML = models.map((name) => `<option>${escapeHtml(name)}</option>`).join("");
  select.value = modelOf(currentChat()) ?? "";
  select.disabled = active !== null;
}

function renderComposer() {
  const busy = active !== null;
  $("#send").hidden = busy;
  $("#stop").hidden = !busy;
  $("#send").disabled = busy;
}

function renderAll() {
  renderModels();
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
  refreshCache(); // its model's
}

async function deleteChat(id) {
  if (active && active.chat.id === id) active.controller.abort();
  const deleted = store.chats.find((c) => c.id === id);
  store.chats = store.chats.filter((c) => c.id !== id);
  if (store.current === id) store.current = store.chats[0]?.id ?? null;
  save();
  renderAll();
  // No later request will reuse its cache entries: the server frees them (those its
  // prompt_cache_key labels, no other conversation's), then the panel shows what is left.
  try {
    for (const model of deleted.models || [undefined]) {
      const query = model ? `?model=${encodeURIComponent(model)}` : "";
      await fetch(`v1/mlxkv/cache/${encodeURIComponent(id)}${query}`, { method: "DELETE", headers: headers() });
    }
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
    messages,
    stream: true,
    stream_options: { include_usage: true },
    prompt_cache_key: chat.id,
  };
  if (modelOf(chat)) body.model = modelOf(chat);
  // Sent as typed, so the server (not the page) says what is wrong with a value.
  if (settings.temperature !== "") body.temperature = Number(settings.temperature);
  if (settings.maxTokens !== "") body.max_tokens = Number(settings.maxTokens);
  return body;
}

async function errorMessage(response) {
  const detail = await errorDetail(response);
  if (response.status === 401) {
    $("#settings").open = true;
    return `${detail}. Enter the server's API key in Settings.`;
  }
  return detail;
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
  // the models whose caches hold this conversation: each frees its entries when it is deleted
  const model = modelOf(chat);
  if (model && !(chat.models ||= []).includes(model)) chat.models.push(model);
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

let cacheReads = 0; // reads of the panel's report asked; an answer to an older one is stale

async function refreshCache() {
  const read = ++cacheReads;
  let report = null;
  try {
    const response = await fetch(forModel("v1/mlxkv/cache"), { headers: headers() });
    report = response.ok ? await response.json() : { unavailable: await errorDetail(response), status: response.status };
  } catch {
    /* the server is gone: no report */
  }
  if (read !== cacheReads) return; // another model's, or older than one already shown
  lastReport = report;
  renderCache($("#cache-panel"), lastReport, titleOf);
}

// Polled while shown, except for a model not loaded (it loads on its first request, after
// which the panel is read again).
function pollCache() {
  if (document.visibilityState === "visible" && !$("#cache-panel").hidden && lastReport?.status !== 409) refreshCache();
  setTimeout(pollCache, CACHE_POLL_MS);
}

async function loadModels() {
  try {
    const response = await fetch("v1/models", { headers: headers() });
    if (!response.ok) return;
    const listed = (await response.json()).data || [];
    models = listed.filter((m) => !(m.capabilities || []).includes("embedding")).map((m) => m.id);
  } catch {
    return; /* the server is gone: requests say so */
  }
  renderModels();
  refreshCache();
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
  $("#model").addEventListener("change", (event) => {
    const chat = currentChat() || newChat();
    chat.model = settings.model = event.target.value;
    save();
    renderAll();
    refreshCache();
  });
  $("#system").addEventListener("input", (event) => {
    const chat = currentChat() || newChat();
    chat.system = event.target.value;
    save();
  });
  $("#api-key").addEventListener("change", loadModels); // the listing is refused without the key
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
  // the text being edited outlives a redraw (another conversation opened and this one again)
  $("#messages").addEventListener("input", (event) => {
    if (editing && event.target.classList.contains("edit-input")) editing.draft = event.target.value;
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
  // At phone width the panel would cover the chat: closed there, also when the window narrows.
  const phone = window.matchMedia("(max-width: 720px)");
  const closePanel = () => {
    $("#cache-panel").hidden = true;
    $("#toggle-cache").setAttribute("aria-expanded", "false");
  };
  if (phone.matches) closePanel();
  phone.addEventListener("change", (event) => event.matches && closePanel());
  // the conversation list slid over the chat closes on a click beside it
  $("main").addEventListener("click", (event) => {
    if (!event.target.closest("#menu")) closeDrawers();
  });
}

wire();
renderAll();
loadModels();
pollCache();
