"""The ASGI app: every API's routes (OpenAI, Responses, Anthropic, Ollama) and the chat page,
middleware, error handlers and the served models' lifetime.

Owns: `create_app` and the rule that no request ends in a traceback: validation errors are
400s with the field and what to fix, unknown paths 404s, each in the shape of the API the path
belongs to (`errors.py`). An unexpected failure is logged with its traceback and answered 500
with one line.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from mlxkv.config import ServerConfig
from mlxkv.errors import RanksOutOfStepError
from mlxkv.runner.runner import Runner
from mlxkv.server.anthropic_api import models as anthropic_models
from mlxkv.server.anthropic_api import routes as anthropic
from mlxkv.server.anthropic_api.diagnostics import keep_prompt_records
from mlxkv.server.anthropic_api.threads import keep_threads
from mlxkv.server.browsers import HostCheck, OriginCheck
from mlxkv.server.errors import ApiError, error_response
from mlxkv.server.middleware import (
    AccessLog,
    ApiKeyCheck,
    BodyDeadline,
    BodyLimit,
    ServerErrors,
)
from mlxkv.server.models.model import ModelLoader
from mlxkv.server.models.resident import SHUTDOWN_SAVE_S
from mlxkv.server.models.served import ReleaseModels, ServedModels
from mlxkv.server.models.streams import StartStreams
from mlxkv.server.ollama_api import embed as ollama_embed
from mlxkv.server.ollama_api import routes as ollama
from mlxkv.server.openai_api import embeddings as openai_embeddings
from mlxkv.server.openai_api import routes as openai
from mlxkv.server.responses_api import routes as responses
from mlxkv.server.responses_api import state_routes
from mlxkv.server.responses_api.background import background_responses, keep_background
from mlxkv.server.responses_api.conversations import keep_conversations
from mlxkv.server.responses_api.history import keep_responses
from mlxkv.server.responses_api.saved import SavedFiles
from mlxkv.server.state import ServerContext, server_context
from mlxkv.server.ui.page import add_page
from mlxkv.server.worker import GenerationWorker

logger = logging.getLogger(__name__)


def create_app(
    runner: Runner | Mapping[str, Runner | ModelLoader],
    config: ServerConfig | None = None,
    **options: Any,
) -> FastAPI:
    """The app (OpenAI, Responses, Anthropic and Ollama APIs) for a loaded Runner, or several
    models by name (serve it with uvicorn).

    Generations start in arrival order, up to the Runner's `max_batch` decoded together in one
    batch (more wait their turn); the app owns the Runner while it serves (generating with it
    elsewhere meanwhile only makes requests wait). With one Runner, any model name a client
    sends is answered by it; with several, the request's `model` chooses
    (`models.served.ServedModels`: exact names, then `config.model_aliases`, else a 404 listing
    them), each with its own worker and cache. A model given as a `ModelLoader` loads on its
    first request and unloads after its keep-alive (`config.keep_alive_s`, or a request's
    `keep_alive`) or when another needs the memory (`config.max_memory_bytes`); a Runner given
    loaded stays.

    Args:
        runner: the model and its prompt cache; or several by name (Runners or
            `ModelLoader`s), the first the default.
        config: the server's settings (`mlxkv.config.ServerConfig`: model name, API key,
            CORS origins, body limit, default max tokens); None for defaults.
        **options: `ServerConfig` fields replacing those of `config`.

    Raises:
        ValueError: an unknown option, or one of the wrong type or out of range.
    """
    config = ServerConfig.of(config, options)
    models = _served_models(runner, config)

    @asynccontextmanager
    async def lifespan(served: FastAPI) -> AsyncIterator[None]:
        saved = SavedFiles.open(config.state_dir)  # None: kept in memory only
        try:
            _keep_responses_state(served, saved)
            yield
            await background_responses(served).close()  # they end before the models do
        finally:  # after the background responses, which store theirs
            if saved is not None:
                saved.close()
            models.residency.shutdown(SHUTDOWN_SAVE_S)

    app = FastAPI(title="mlxkv", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.mlxkv = ServerContext.make(
        models, config.default_max_tokens, config.max_tokens_limit, config.fetch_images
    )
    _keep_responses_state(app, None)  # an app served without its lifespan: in memory
    keep_threads(app)
    keep_prompt_records(app)
    _add_routes(app)
    # innermost: a stream starts while its model loads, after the checks of the body
    streams = {**openai.STREAMS, **anthropic.STREAMS, **responses.STREAMS, **ollama.STREAMS}
    app.add_middleware(StartStreams, models=models, shapes=streams)
    _add_middleware(app, config, memory_line=_memory_line)
    app.add_middleware(ReleaseModels, models=models)  # outermost: after the access line
    return app


def _keep_responses_state(app: FastAPI, saved: SavedFiles | None) -> None:
    """Gives `app` what the Responses API keeps (stored responses, background responses,
    conversations), in `saved`'s files too (those read now)."""
    app.state.saved = saved
    keep_responses(app, saved)
    keep_background(app)
    keep_conversations(app, saved)
    if saved is not None:
        where = (saved.directory, saved.num_read)
        logger.info("responses: stored responses and conversations in %s (%d read)", *where)


def _memory_line(scope: Any) -> str:
    """The memory line of the model that served the request."""
    context = scope.get("state", {}).get("mlxkv")
    worker = None if context is None else context.worker
    return "" if worker is None else worker.runner.memory_line


def _add_routes(app: FastAPI) -> None:
    """Every API's routes, /health, the chat page, and the errors in each API's shape."""
    app.include_router(anthropic_models.router)  # before OpenAI's: the same paths
    app.include_router(openai.router)
    app.include_router(anthropic.router)
    app.include_router(responses.router)
    app.include_router(state_routes.router)
    app.include_router(ollama.router)
    app.include_router(openai_embeddings.router)
    app.include_router(ollama_embed.router)
    app.add_api_route("/health", _health, methods=["GET", "HEAD"])  # HEAD: clients probing
    add_page(app)
    _add_error_handlers(app)


def _add_middleware(app: FastAPI, config: ServerConfig, memory_line: Callable[[Any], str]) -> None:
    """The middleware, added innermost first: the access log sees every response, 401s and
    413s included; `BodyDeadline` holds every refusal sent before its body was read (401,
    403, 413) until the body has been read."""
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    if config.api_key:
        app.add_middleware(ApiKeyCheck, api_key=config.api_key)
    if config.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.cors_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
        )
    app.add_middleware(OriginCheck, allowed_origins=(*config.cors_origins, *config.allowed_origins))
    app.add_middleware(HostCheck, bound_host=config.host, allowed_hosts=config.allowed_hosts)
    # outside every check that may answer before the body is read: that answer waits for it
    app.add_middleware(BodyDeadline)
    app.add_middleware(ServerErrors)
    app.add_middleware(AccessLog, memory_line=memory_line)


def _served_models(
    runner: Runner | Mapping[str, Runner | ModelLoader], config: ServerConfig
) -> ServedModels:
    """The models by name (one Runner: `config.model_name`, else its directory's name), each
    with a worker of its own while loaded."""
    if isinstance(runner, Runner):
        runner = {config.model_name or runner.loaded.path.name: runner}
    return ServedModels(
        runner,
        lambda loaded: GenerationWorker(loaded, config.max_queue, config.queue_timeout_s),
        config.model_aliases,
        budget_bytes=config.max_memory_bytes,
        keep_alive_s=config.keep_alive_s,
    )


async def _health(request: Request) -> Any:
    ctx = await server_context(request)
    if ctx.worker is None:  # loads on its first request
        return {"status": "ok", "model": ctx.model_name, "loaded": False}
    runner = ctx.worker.runner
    if runner.health is not None:  # it cannot serve (a sharded model's ranks out of step)
        return JSONResponse({"status": "error", "error": runner.health}, status_code=503)
    info = runner.cache_info()
    cache = {"tokens": info.num_tokens, "bytes": info.allocated_bytes}
    return {"status": "ok", "model": ctx.model_name, "cache": cache}


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return error_response(
            request.scope,
            error.status,
            error.message,
            code=error.code,
            param=error.param,
            headers=error.headers,
            details=error.details,
        )

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError):
        message, param = _describe(error.errors())
        return error_response(request.scope, 400, message, param=param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        return error_response(
            request.scope, error.status_code, str(error.detail), headers=error.headers
        )

    @app.exception_handler(RanksOutOfStepError)
    async def cannot_serve(request: Request, error: RanksOutOfStepError):
        return error_response(request.scope, 503, str(error))


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
