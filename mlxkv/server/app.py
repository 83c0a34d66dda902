"""The ASGI app: routes of both APIs, middleware, error handlers and the worker's lifetime.

Owns: `create_app` and the rule that no request ends in a traceback: validation errors are
400s with the field and what to fix, unknown paths 404s, each in the shape of the API the path
belongs to (`errors.py`). An unexpected failure is logged with its traceback and answered 500
with one line.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException

from mlxkv.engine.runner import Runner
from mlxkv.server.anthropic_api import routes as anthropic
from mlxkv.server.errors import ApiError, error_response
from mlxkv.server.middleware import AccessLog, ApiKeyCheck, BodyLimit
from mlxkv.server.openai_api import routes as openai
from mlxkv.server.state import ServerContext, server_context
from mlxkv.server.ui.page import add_page
from mlxkv.server.worker import GenerationWorker

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 32 * 1024**2  # far above a 128k-token prompt as JSON
DEFAULT_MAX_TOKENS = 1024  # generated when a request sets no limit (OpenAI's may leave it out)


def create_app(
    runner: Runner,
    *,
    model_name: str | None = None,
    api_key: str | None = None,
    cors_origins: Sequence[str] = (),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
) -> FastAPI:
    """The OpenAI- and Anthropic-compatible app for a loaded Runner (serve it with uvicorn).

    Generations run one at a time on a thread of the app's own, in arrival order; the app owns
    the Runner while it serves (generating with it elsewhere meanwhile only makes requests
    wait). Any model name a client sends is answered by this model.

    Args:
        runner: the model and its prompt cache.
        model_name: the id `/v1/models` lists; default: the model directory's name.
        api_key: when set, every path but /health needs it (Bearer or x-api-key).
        cors_origins: browser origins allowed to call the API ("*" for any).
        max_body_bytes: largest request body accepted, in bytes.
        default_max_tokens: tokens generated when a request sets no limit.
    """
    worker = GenerationWorker(runner)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        worker.shutdown()

    app = FastAPI(title="mlxkv", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.mlxkv = ServerContext.make(
        worker, model_name or runner.loaded.path.name, default_max_tokens
    )
    app.include_router(openai.router)
    app.include_router(anthropic.router)
    app.add_api_route("/health", _health, methods=["GET"])
    add_page(app)
    _add_error_handlers(app)
    # Added innermost first: the access log sees every response, 401s and 413s included.
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyCheck, api_key=api_key)
    if cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
        )
    app.add_middleware(AccessLog, memory_line=lambda: runner.memory_line)
    return app


async def _health(request: Request) -> dict[str, Any]:
    ctx = server_context(request)
    info = ctx.worker.runner.cache_info()
    cache = {"tokens": info.num_tokens, "bytes": info.allocated_bytes}
    return {"status": "ok", "model": ctx.model_name, "cache": cache}


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return error_response(
            request.url.path, error.status, error.message, code=error.code, param=error.param
        )

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError):
        message, param = _describe(error.errors())
        return error_response(request.url.path, 400, message, param=param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        return error_response(
            request.url.path, error.status_code, str(error.detail), headers=error.headers
        )

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception):
        logger.exception("request failed: %s %s", request.method, request.url.path)
        message = f"internal error ({type(error).__name__}); the server log has the details"
        return error_response(request.url.path, 500, message)


def _describe(errors: Sequence[Any]) -> tuple[str, str | None]:
    """One message for pydantic's errors: each as `field: problem`, the body's own path."""
    problems, param = [], None
    for error in errors:
        if error.get("type") == "json_invalid":
            detail = error.get("ctx", {}).get("error", "")
            return f"request body is not valid JSON ({detail})", None
        if tuple(error.get("loc", ())) == ("body",) and error.get("type") == "missing":
            return "the request body is empty; send a JSON object", None
        location = [str(part) for part in error.get("loc", ()) if part != "body"]
        # A union's branches add their type names to the path; they say nothing to a client.
        location = [part for part in location if not _is_type_tag(part)]
        field = ".".join(location)
        param = param or field or None
        problems.append(f"{field}: {error.get('msg')}" if field else str(error.get("msg")))
    unique = list(dict.fromkeys(problems))
    shown = "; ".join(unique[:5]) + (f"; and {len(unique) - 5} more" if len(unique) > 5 else "")
    return f"invalid request: {shown}", param


def _is_type_tag(part: str) -> bool:
    return (
        part in {"str", "int", "float", "bool", "list", "dict"}
        or part.startswith(("list[", "dict[", "function-", "literal[", "tagged-union["))
        or part[:1].isupper()
    )
