// A turn of a conversation: the message sent (with its images), the request made from the
// conversation as it stands, and the reply streamed into it; a reply asked again (Retry) and a
// message changed and sent again (Edit).

import { errorDetail, readEvents } from "./stream.js";
import { currentChat, headers, modelOf, newChat, save, session, settings, store } from "./state.js";
import { $, renderAll, renderAttached, renderMessage } from "./view.js";
import { refreshCache } from "./refresh.js";

const titleFrom = (text) => text.replace(/\s+/g, " ").slice(0, 48);

// A user message with pasted or dropped images: OpenAI's image_url parts before the text.
function contentParts(message) {
  const images = message.images.map((url) => ({ type: "image_url", image_url: { url } }));
  return [...images, { type: "text", text: message.content }];
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

export async function send(text) {
  const chat = currentChat() || newChat();
  if (chat.title === "New chat") chat.title = titleFrom(text);
  const attached = session.attached;
  chat.messages.push(attached.length ? { role: "user", content: text, images: attached } : { role: "user", content: text });
  session.attached = [];
  renderAttached();
  session.editing = null;
  await reply(chat);
}

// Another reply to the same prompt, in place of the last one: the server has all of that
// prompt in its cache, so the new reply starts at once.
export function retry(chat) {
  chat.messages.pop();
  reply(chat);
}

// A user message changed and sent again: the turns after it are dropped (as they answered
// the old text), and the server reuses the conversation's cache up to the change.
export function resend(chat, index, text) {
  const message = chat.messages[index];
  if (!text && !message.images?.length) return;
  if (chat.messages.findIndex((m) => m.role === "user") === index && chat.title === titleFrom(message.content)) {
    chat.title = titleFrom(text);
  }
  message.content = text;
  chat.messages.length = index + 1;
  session.editing = null;
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
  session.active = { chat, message, controller };
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
    session.active = null;
    save();
    renderAll();
    refreshCache();
    $("#input").focus();
  }
}

export function stop() {
  if (session.active) session.active.controller.abort();
}
