// The chat page: conversations kept in the browser's local storage, each with the served model
// it talks to; replies streamed from the server's own OpenAI endpoint; a live view of the cache.
// This module wires the page's controls to what they do; what it holds is in state.js, how it
// is drawn in view.js, a turn in reply.js, what it reads from the server by itself in refresh.js.

import { currentChat, headers, newChat, save, session, settings, store } from "./state.js";
import { $, renderAll, renderAttached } from "./view.js";
import { loadModels, pollCache, refreshCache } from "./refresh.js";
import { resend, retry, send, stop } from "./reply.js";

// ---- actions -----------------------------------------------------------------------------

function switchTo(id) {
  store.current = id;
  save();
  renderAll();
  closeDrawers();
  refreshCache(); // its model's
}

async function deleteChat(id) {
  if (session.active && session.active.chat.id === id) session.active.controller.abort();
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

function attach(files) {
  for (const file of files) {
    if (!file.type.startsWith("image/")) continue;
    const reader = new FileReader();
    reader.onload = () => {
      session.attached.push(reader.result);
      renderAttached();
    };
    reader.readAsDataURL(file);
  }
}

// ---- wiring ------------------------------------------------------------------------------

// Edit, Send, Cancel and Retry under a message of the current conversation.
function messageAction(button) {
  const chat = currentChat();
  const index = Number(button.closest(".message")?.dataset.index);
  if (!chat || session.active || !(index in chat.messages)) return;
  const last = index === chat.messages.length - 1;
  if (button.classList.contains("retry") && last && chat.messages[index].role === "assistant") retry(chat);
  else if (button.classList.contains("edit")) session.editing = { chatId: chat.id, index };
  else if (button.classList.contains("cancel")) session.editing = null;
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
    if ((!text && !session.attached.length) || session.active) return;
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
  // Open and Delete of a conversation in the list (view.js draws it afresh on each change).
  $("#conversations").addEventListener("click", (event) => {
    const button = event.target.closest("button");
    const id = button?.closest("li")?.dataset.id;
    if (id === undefined) return;
    if (button.classList.contains("open")) switchTo(id);
    else if (button.classList.contains("delete")) deleteChat(id);
  });
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
    if (session.editing && event.target.classList.contains("edit-input")) session.editing.draft = event.target.value;
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
