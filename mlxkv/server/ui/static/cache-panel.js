// The cache panel: what the runner holds (GET v1/mlxkv/cache), and a chart of time to first
// token and cached fraction per turn of the current conversation.

import { escapeHtml } from "./markdown.js";

export function formatBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let size = n;
  let unit = 0;
  while (Math.abs(size) >= 1024 && unit < units.length - 1) {
    size /= 1024;
    unit++;
  }
  return unit === 0 ? `${size} B` : `${size.toFixed(1)} ${units[unit]}`;
}

function ago(seconds) {
  const s = Math.max(0, Math.round(Date.now() / 1000 - seconds));
  if (s < 60) return `${s} s ago`;
  if (s < 3600) return `${Math.floor(s / 60)} min ago`;
  return `${Math.floor(s / 3600)} h ago`;
}

function meter(label, value, total) {
  const pct = total ? Math.min(100, (100 * value) / total) : 0;
  const of = total ? ` of ${formatBytes(total)}` : "";
  return (
    `<div class="meter"><div class="meter-label"><span>${label}</span>` +
    `<span>${formatBytes(value)}${of}</span></div>` +
    // the width is set through the DOM: the page's Content-Security-Policy has no inline styles
    `<div class="meter-bar"><div data-pct="${pct.toFixed(1)}"></div></div></div>`
  );
}

export function renderCache(el, report, titleOf) {
  if (!report || report.unavailable) {
    const why = report ? escapeHtml(report.unavailable) : "Cache report unavailable.";
    el.querySelector("#cache-summary").innerHTML = `<p class="muted">${why}</p>`;
    el.querySelector("#cache-entries tbody").innerHTML = "";
    return;
  }
  const entries = [...report.entries].reverse(); // most recently used first
  const budget = report.budget_bytes;
  el.querySelector("#cache-summary").innerHTML =
    `<p class="muted">${escapeHtml(report.model)} · context ${report.max_context.toLocaleString()} tokens</p>` +
    meter("Held by entries", report.held_bytes, budget) +
    `<dl class="figures">` +
    `<dt>Tokens cached</dt><dd data-field="num_tokens">${report.num_tokens.toLocaleString()}</dd>` +
    `<dt>In use</dt><dd data-field="used_bytes">${formatBytes(report.used_bytes)}</dd>` +
    `<dt>Allocated</dt><dd data-field="allocated_bytes">${formatBytes(report.allocated_bytes)}</dd>` +
    `<dt>Peak (last request)</dt><dd data-field="peak_bytes">${formatBytes(report.peak_bytes)}</dd>` +
    (report.checkpoint_bytes ? `<dt>Checkpoints</dt><dd>${formatBytes(report.checkpoint_bytes)}</dd>` : "") +
    `<dt>Entries</dt><dd data-field="entries">${entries.length} of ${report.max_entries}</dd>` +
    `<dt>Disk tier</dt><dd data-field="disk">${
      report.disk_budget_bytes === null
        ? "off"
        : `${report.disk_entries} blocks, ${formatBytes(report.disk_bytes)} of ${formatBytes(report.disk_budget_bytes)}`
    }</dd></dl>`;
  for (const bar of el.querySelectorAll("#cache-summary [data-pct]")) {
    bar.style.width = `${bar.dataset.pct}%`;
  }
  const rows = entries.map((e) => {
    const title = (e.label && titleOf(e.label)) || (e.label ? "another client" : "–");
    return (
      `<tr class="${e.current ? "current" : ""}"><td>${escapeHtml(title)}${e.current ? " ●" : ""}</td>` +
      `<td class="num">${e.num_tokens.toLocaleString()}</td>` +
      `<td class="num">${formatBytes(e.allocated_bytes)}</td><td class="num">${ago(e.last_used)}</td></tr>`
    );
  });
  el.querySelector("#cache-entries tbody").innerHTML =
    rows.join("") || '<tr><td colspan="4" class="muted">No entries yet</td></tr>';
}

// Bars: time to first token (left axis, seconds); dots and line: cached fraction (0-100 %).
export function renderChart(svg, turns) {
  const W = 300;
  const H = 140;
  const pad = { l: 34, r: 34, t: 10, b: 22 };
  const w = W - pad.l - pad.r;
  const h = H - pad.t - pad.b;
  if (!turns.length) {
    svg.innerHTML = `<text x="${W / 2}" y="${H / 2}" text-anchor="middle" class="axis">No turns yet</text>`;
    return;
  }
  const maxTtft = Math.max(...turns.map((t) => t.ttft_s || 0), 0.001);
  const step = w / turns.length;
  const barW = Math.max(2, Math.min(24, step * 0.6));
  const parts = [
    `<line x1="${pad.l}" y1="${pad.t + h}" x2="${pad.l + w}" y2="${pad.t + h}" class="grid"/>`,
    `<text x="${pad.l - 4}" y="${pad.t + 8}" text-anchor="end" class="axis">${maxTtft.toFixed(2)}s</text>`,
    `<text x="${pad.l - 4}" y="${pad.t + h}" text-anchor="end" class="axis">0</text>`,
    `<text x="${pad.l + w + 4}" y="${pad.t + 8}" class="axis">100%</text>`,
    `<text x="${pad.l + w + 4}" y="${pad.t + h}" class="axis">0%</text>`,
  ];
  const points = [];
  turns.forEach((t, i) => {
    const x = pad.l + step * i + step / 2;
    const bh = ((t.ttft_s || 0) / maxTtft) * h;
    parts.push(
      `<rect class="bar" x="${(x - barW / 2).toFixed(1)}" y="${(pad.t + h - bh).toFixed(1)}" ` +
        `width="${barW.toFixed(1)}" height="${bh.toFixed(1)}"><title>turn ${i + 1}: ` +
        `${(t.ttft_s || 0).toFixed(3)} s to first token</title></rect>`,
    );
    const frac = t.prompt ? t.cached / t.prompt : 0;
    points.push([x, pad.t + h - frac * h, frac, i]);
    parts.push(`<text x="${x.toFixed(1)}" y="${H - 6}" text-anchor="middle" class="axis">${i + 1}</text>`);
  });
  parts.push(`<polyline class="cached-line" points="${points.map((p) => `${p[0].toFixed(1)},${p[1].toFixed(1)}`).join(" ")}"/>`);
  for (const [x, y, frac, i] of points) {
    parts.push(
      `<circle class="cached-dot" cx="${x.toFixed(1)}" cy="${y.toFixed(1)}" r="3">` +
        `<title>turn ${i + 1}: ${(frac * 100).toFixed(0)}% of the prompt from the cache</title></circle>`,
    );
  }
  svg.innerHTML = parts.join("");
}
