// A small Markdown renderer for model replies: fenced code, headings, lists, quotes, rules,
// paragraphs; inline code, bold, italic and http(s) links. Safe by construction: the text is
// HTML-escaped before any markup is added, so nothing a model writes becomes live HTML.
// Streaming-friendly: an unterminated code fence renders as code up to the end.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

function inline(escaped) {
  const spans = [];
  // Code spans first, so nothing inside them is formatted.
  let out = escaped.replace(/`([^`\n]+)`/g, (_, code) => {
    spans.push(`<code>${code}</code>`);
    return `\u0000${spans.length - 1}\u0000`;
  });
  out = out
    .replace(
      /\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)/g,
      '<a href="$2" target="_blank" rel="noopener noreferrer">$1</a>',
    )
    .replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^*\w])\*([^*\s][^*\n]*?)\*(?![*\w])/g, "$1<em>$2</em>")
    .replace(/(^|[^\w])_([^_\s][^_\n]*?)_(?!\w)/g, "$1<em>$2</em>");
  return out.replace(/\u0000(\d+)\u0000/g, (_, i) => spans[Number(i)]);
}

const FENCE = /^\s*```\s*([\w+#.-]*)\s*$/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const NUMBERED = /^\s*\d+[.)]\s+(.*)$/;
const QUOTE = /^\s*&gt;\s?(.*)$/;
const RULE = /^\s*([-*_])(\s*\1){2,}\s*$/;

function codeBlock(lang, lines) {
  const cls = lang ? ` class="language-${lang}"` : "";
  return (
    `<div class="code"><button type="button" class="copy" aria-label="Copy code">Copy</button>` +
    `<pre><code${cls}>${lines.join("\n")}</code></pre></div>`
  );
}

export function renderMarkdown(text) {
  const lines = escapeHtml(text.replace(/\u0000/g, "")).split("\n");
  const html = [];
  let paragraph = [];
  let list = null; // { tag: "ul" | "ol", items: [] }
  let quote = [];

  const flushParagraph = () => {
    if (paragraph.length) html.push(`<p>${inline(paragraph.join("<br>"))}</p>`);
    paragraph = [];
  };
  const flushList = () => {
    if (list) html.push(`<${list.tag}>${list.items.map((i) => `<li>${inline(i)}</li>`).join("")}</${list.tag}>`);
    list = null;
  };
  const flushQuote = () => {
    if (quote.length) html.push(`<blockquote>${inline(quote.join("<br>"))}</blockquote>`);
    quote = [];
  };
  const flushAll = () => {
    flushParagraph();
    flushList();
    flushQuote();
  };

  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = line.match(FENCE);
    if (fence) {
      flushAll();
      const body = [];
      i++;
      while (i < lines.length && !FENCE.test(lines[i])) body.push(lines[i++]);
      html.push(codeBlock(fence[1], body));
      continue;
    }
    let m;
    if (!line.trim()) {
      flushAll();
    } else if (RULE.test(line)) {
      flushAll();
      html.push("<hr>");
    } else if ((m = line.match(HEADING))) {
      flushAll();
      const level = m[1].length;
      html.push(`<h${level}>${inline(m[2])}</h${level}>`);
    } else if ((m = line.match(BULLET)) || (m = line.match(NUMBERED))) {
      const tag = BULLET.test(line) ? "ul" : "ol";
      flushParagraph();
      flushQuote();
      if (list && list.tag !== tag) flushList();
      list = list || { tag, items: [] };
      list.items.push(m[1]);
    } else if ((m = line.match(QUOTE))) {
      flushParagraph();
      flushList();
      quote.push(m[1]);
    } else if (list && /^\s{2,}\S/.test(line)) {
      list.items[list.items.length - 1] += " " + line.trim(); // a wrapped list item
    } else {
      flushList();
      flushQuote();
      paragraph.push(line);
    }
  }
  flushAll();
  return html.join("");
}
