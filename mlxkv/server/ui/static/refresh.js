// What the page reads from the server by itself: the chat models it serves (at load, and again
// once the API key is given) and the cache panel's report (after each change, and polled while
// the panel shows).

import { errorDetail } from "./stream.js";
import { renderCache } from "./cache-panel.js";
import { forModel, headers, session, titleOf } from "./state.js";
import { $, renderModels } from "./view.js";

const CACHE_POLL_MS = 2000;

let lastReport = null;
let cacheReads = 0; // reads of the panel's report asked; an answer to an older one is stale

export async function refreshCache() {
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
export function pollCache() {
  if (document.visibilityState === "visible" && !$("#cache-panel").hidden && lastReport?.status !== 409) refreshCache();
  setTimeout(pollCache, CACHE_POLL_MS);
}

export async function loadModels() {
  try {
    const response = await fetch("v1/models", { headers: headers() });
    if (!response.ok) return;
    const listed = (await response.json()).data || [];
    session.models = listed.filter((m) => !(m.capabilities || []).includes("embedding")).map((m) => m.id);
  } catch {
    return; /* the server is gone: requests say so */
  }
  renderModels();
  refreshCache();
}
