"""The chat page and the JSON it reads: `GET /` (the page), `/static/...` (its files),
`GET /v1/mlxkv/cache` (the prompt cache, live) and `DELETE /v1/mlxkv/cache/{cache_key}` (the
entries of a conversation the page deleted).

Owns the routes; the page itself is plain HTML, CSS and JavaScript in `static/`, shipped in
the package (no build step, nothing fetched at run time). Cache policy stays in the Runner:
this only reports `Runner.cache_info()` and passes a deletion on.

`GET /v1/mlxkv/cache` returns every field of `MemoryReport` under the same name (bytes as
integers, `last_used` in Unix seconds, entries least recently used first, each with the
`label` its last request's `prompt_cache_key` gave it), plus `model` and `max_context`
(tokens).
"""

from __future__ import annotations

import dataclasses
from importlib.resources import files
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool

from mlxkv.server.errors import ApiError
from mlxkv.server.models.served import named_context

STATIC_DIR = files("mlxkv.server.ui") / "static"

router = APIRouter()

# The page needs nothing from another origin: no third-party script, style, image or frame
# (an image URL in a model's Markdown answer cannot leak the conversation), and no site may
# frame it (clickjacking). Revalidated on each load, so a new version is never served stale.
_PAGE_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; "
        "form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


@router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
async def chat_page() -> FileResponse:
    return FileResponse(str(STATIC_DIR / "index.html"), headers=_PAGE_HEADERS)


@router.get("/v1/mlxkv/cache")
async def cache_report(request: Request, model: str | None = None) -> dict[str, Any]:
    """The cache of the served model `model` names (the default one without it): a 404 listing
    the names for another; loads nothing."""
    ctx = named_context(request, model)
    if ctx.worker is None:
        raise ApiError(
            409, f"model '{ctx.model_name}' is not loaded; it loads on its first request"
        )
    runner = ctx.worker.runner
    report = dataclasses.asdict(runner.cache_info())
    # Entries of a cache_salt are another tenant's: their sizes and labels are not listed
    # (the totals still count them).
    report["entries"] = [e for e in report["entries"] if not e.pop("isolated")]
    return {**report, "model": ctx.model_name, "max_context": runner.max_context}


@router.delete("/v1/mlxkv/cache/{cache_key:path}")
async def drop_entries(request: Request, cache_key: str, model: str | None = None):
    """Frees the entries of the served model `model` names (the default one without it) whose
    last request gave `cache_key` as its `prompt_cache_key`: the page's conversation it
    deleted (`Runner.drop_cache_entries`). A model not loaded holds none."""
    ctx = named_context(request, model)
    if ctx.worker is None:
        return {"cache_key": cache_key, "dropped_entries": 0}
    dropped = await run_in_threadpool(ctx.worker.runner.drop_cache_entries, cache_key)
    return {"cache_key": cache_key, "dropped_entries": dropped}


def add_page(app: FastAPI) -> None:
    """Adds the page, its files and the cache report to `app`."""
    app.include_router(router)
    app.mount("/static", StaticFiles(directory=str(STATIC_DIR)), name="static")
