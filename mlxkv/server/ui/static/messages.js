// How one message of a conversation is drawn: its bubble (Markdown for replies, thinking
// folded above), the stats line under a reply, its buttons, and the editor of an edited one.

import { renderMarkdown, escapeHtml } from "./markdown.js";

function statsLine(stats) {
  const parts = [
    `<span data-stat="prompt">prompt ${stats.prompt} tokens</span>`,
    `<span data-stat="cached">cached ${stats.cached}</span>`,
  ];
  if (stats.ttft_s != null) parts.push(`<span data-stat="ttft">first token ${stats.ttft_s.toFixed(2)} s</span>`);
  if (stats.tps != null) parts.push(`<span data-stat="tps">${stats.tps.toFixed(1)} tokens/s</span>`);
  return parts.join(" · ");
}

export function imagesHtml(images) {
  return (images || []).map((url) => `<img class="thumb" alt="attached image" src="${escapeHtml(url)}">`).join("");
}

// The buttons under a message, shown while nothing is generating (`busy`): Edit on each message the
// user wrote, Retry on the last reply.
export function actionsHtml(message, { busy, last }) {
  if (busy || message.pending) return "";
  const button = (name, label) => `<button type="button" class="${name}" title="${label}">${label}</button>`;
  if (message.role === "user") return `<div class="actions">${button("edit", "Edit")}</div>`;
  return last ? `<div class="actions">${button("retry", "Retry")}</div>` : "";
}

// The editor of a message the user wrote: `draft`, the text typed so far, else the message's.
export function editorHtml(message, draft) {
  return (
    `<div class="editor">${imagesHtml(message.images)}` +
    `<textarea class="edit-input" rows="3" aria-label="Edit the message">${escapeHtml(draft ?? message.content)}</textarea>` +
    '<div class="actions"><button type="button" class="cancel">Cancel</button>' +
    '<button type="button" class="save primary">Send</button></div></div>'
  );
}

export function messageHtml(message, actions = "") {
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
