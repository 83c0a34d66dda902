// The page drawn from what it holds: the conversation list, the current conversation's messages
// and chart, the model picker, the composer's buttons and attached images. Draws only: what a
// click does is wired in app.js.

import { escapeHtml } from "./markdown.js";
import { actionsHtml, editorHtml, imagesHtml, messageHtml } from "./messages.js";
import { renderChart } from "./cache-panel.js";
import { currentChat, modelOf, session, store } from "./state.js";

export const $ = (selector) => document.querySelector(selector);

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
    list.appendChild(li);
  }
}

export function renderMessage(el, message, actions = "") {
  el.className = `message ${message.role}${message.pending ? " pending" : ""}`;
  el.innerHTML = messageHtml(message, actions);
}

function renderMessages() {
  const chat = currentChat();
  const box = $("#messages");
  const editing = session.editing;
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
    } else renderMessage(el, message, actionsHtml(message, { busy: session.active !== null, last: index === chat.messages.length - 1 }));
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

export function renderModels() {
  const select = $("#model");
  select.hidden = session.models.length < 2;
  select.innerHTML = session.models.map((name) => `<option>${escapeHtml(name)}</option>`).join("");
  select.value = modelOf(currentChat()) ?? "";
  select.disabled = session.active !== null;
}

function renderComposer() {
  const busy = session.active !== null;
  $("#send").hidden = busy;
  $("#stop").hidden = !busy;
  $("#send").disabled = busy;
}

export function renderAttached() {
  $("#attachments").innerHTML = imagesHtml(session.attached);
  $("#attachments").hidden = session.attached.length === 0;
}

export function renderAll() {
  renderModels();
  renderList();
  renderMessages();
  renderComposer();
}
