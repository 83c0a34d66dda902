"""Ollama's API: `/api/version`, `/api/tags`, `/api/show`, `/api/ps`, `/api/chat`,
`/api/generate` (streamed NDJSON, Ollama's default, or one object), `/api/pull` (success for
a served model, a 404 for any other), `/api/create`, `/api/copy`, `/api/delete` and
`/api/push` (501: it serves the one model it started with; Open WebUI's model settings offer
them, where a bare 404 "Not Found" said nothing of why). Embeddings are in `embed.py`.

Each served model is listed under its name with the tag `latest`, unless the name holds a tag
(an Ollama model's "llama3.2:1b") (`/api/ps`: those loaded, with their sizes and when they
unload); with one model served, chat and generate answer any name with it, as the other APIs
do (`keep_alive` is read by `models.served`). A thinking model's thinking comes as
`message.thinking` (chat) and `thinking` (generate) unless `think` is
false, as Ollama does.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from mlxkv.runner.results import Completion
from mlxkv.server.errors import ApiError
from mlxkv.server.models.served import named_context, ollama_name, unload_named
from mlxkv.server.models.streams import StreamShape
from mlxkv.server.ollama_api.protocol import ChatRequest, GenerateRequest, ModelRequest
from mlxkv.server.reply.start import start_turn
from mlxkv.server.reply.tool_calls import ToolCall
from mlxkv.server.reply.turn import ReasoningDelta, TextDelta, Turn, collect
from mlxkv.server.state import Context, ServerContext, event_stream, server_context

router = APIRouter(prefix="/api")

# The Ollama version clients see; some refuse a server older than the API they need:
# `codex --oss` asks for 0.13.4 or newer (Ollama's `/v1/responses`, which this server has).
OLLAMA_VERSION = "0.13.5"


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": OLLAMA_VERSION}


@router.get("/tags")
async def tags(ctx: Context) -> dict[str, Any]:
    return {"models": [_model_entry(each) for each in ctx.each_model()]}


@router.get("/ps")
async def running(ctx: Context) -> dict[str, Any]:
    entries = [
        {
            **_model_entry(each),
            "size": each.resident.footprint_bytes,  # what it holds: weights and cache budget
            "expires_at": _expiry(each.resident.expires_at),
            "size_vram": 0,
            "context_length": each.worker.runner.max_context,
        }
        for each in ctx.each_model()
        if each.worker is not None
    ]
    return {"models": entries}


def _expiry(expires_at: float | None) -> str:
    """When an idle model unloads; Ollama's far future for one that stays (or is in use)."""
    return "2318-01-01T00:00:00Z" if expires_at is None else _timestamp(expires_at)


@router.post("/show")
async def show(body: ModelRequest, request: Request) -> dict[str, Any]:
    ctx = named_context(request, body.model_name)  # as it is now: showing loads nothing
    _check_served(body.model_name, ctx)
    arch = _model_type(ctx)
    info: dict[str, Any] = {"general.architecture": arch}
    before = ctx.resident.template_facts
    template = "" if before is None else before.chat_template
    if ctx.worker is not None:  # what it runs with
        runner = ctx.worker.runner
        template = getattr(runner.tokenizer, "chat_template", "") or ""
        info[f"{arch}.context_length"] = runner.max_context
    return {
        "modelfile": "",
        "parameters": "",
        "template": template,
        "details": _details(ctx),
        "model_info": info,
        "capabilities": ctx.capabilities.names(ollama=True),
        "modified_at": _timestamp(ctx.created),
    }


@router.post("/pull")
async def pull(body: ModelRequest, request: Request):
    # a served model is there already: pulling loads nothing (under --max-memory a load
    # would unload another model)
    ctx = named_context(request, body.model_name)
    _check_served(body.model_name, ctx)
    if not body.stream:
        return {"status": "success"}
    lines = [{"status": "pulling manifest"}, {"status": "success"}]
    return StreamingResponse(
        iter(json.dumps(line) + "\n" for line in lines), media_type="application/x-ndjson"
    )


@router.post("/create")
@router.post("/copy")
@router.delete("/delete")
@router.post("/push")
async def manage(request: Request) -> None:
    """Refused without loading a model: under a memory budget a load unloads another."""
    served = request.app.state.mlxkv.models.resident
    names = ", ".join(ollama_name(name) for name in served)
    what = f"'{names}' only, the model" if len(served) == 1 else f"{names}, the models"
    raise ApiError(
        501,
        f"this server serves {what} `mlxkv serve` loads; it does not create, copy, delete or "
        "push models",
    )


@router.post("/chat")
async def chat(body: ChatRequest, request: Request):
    unloads = body.unloads  # first: a keep_alive Ollama refuses is a 400, as there
    if unloads and not body.messages:
        message = {"role": "assistant", "content": ""}
        return _unloaded(request, body, "message", message)
    ctx = await server_context(request)  # the model, loaded
    sampling = body.sampling(ctx.default_max_tokens, ctx.worker.runner.max_context)
    if not body.messages:  # Ollama's way to load a model: nothing to generate
        message = {"role": "assistant", "content": ""}
        return _loaded(body.model or _name(ctx), "load", "message", message)
    turn = await start_turn(
        request,
        body.chat_messages(),
        tools=body.tools or None,
        sampling=sampling,
        max_tokens_asked=False,  # a cap (GenerationRequest.sampling)
        switches=body.template_switches(),
        split_thinking=body.split_thinking,
    )
    return await _answer(turn, request, ctx, body, "message")


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request):
    unloads = body.unloads  # first: a keep_alive Ollama refuses is a 400, as there
    if unloads and not body.prompt:
        return _unloaded(request, body, "response", "")
    ctx = await server_context(request)  # the model, loaded
    sampling = body.sampling(ctx.default_max_tokens, ctx.worker.runner.max_context)
    if not body.prompt:  # loads the model
        return _loaded(body.model or _name(ctx), "load", "response", "")
    turn = await start_turn(
        request,
        body.prompt_for_runner(),
        tools=None,
        sampling=sampling,
        max_tokens_asked=False,  # a cap (GenerationRequest.sampling)
        switches=body.template_switches(),
        split_thinking=body.split_thinking,
    )
    return await _answer(turn, request, ctx, body, "response")


async def _answer(turn: Turn, request: Request, ctx: ServerContext, body: Any, field: str):
    load_ns = ctx.load_duration_ns
    started = time.perf_counter_ns() - load_ns  # Ollama's total includes the load
    model = body.model or _name(ctx)
    if body.stream:
        lines = _lines(turn, model, field, started, load_ns)
        return event_stream(
            lines, turn, _error_line, keepalive=None, media_type="application/x-ndjson"
        )
    events, completion = await collect(turn, request)
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    thinking = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    calls = [e for e in events if isinstance(e, ToolCall)]
    return {
        **_head(model),
        **_payload(field, text, calls, thinking),
        **_final(completion, calls, started, load_ns),
    }


async def _lines(
    turn: Turn, model: str, field: str, started: int, load_ns: int
) -> AsyncIterator[str]:
    calls: list[ToolCall] = []
    async for event in turn.events():
        if isinstance(event, TextDelta) and event.text:
            yield _line({**_head(model), **_payload(field, event.text, []), "done": False})
        elif isinstance(event, ReasoningDelta) and event.text:
            yield _line({**_head(model), **_payload(field, "", [], event.text), "done": False})
        elif isinstance(event, ToolCall):
            calls.append(event)
            yield _line({**_head(model), **_payload(field, "", [event]), "done": False})
        elif isinstance(event, Completion):
            final = {
                **_head(model),
                **_payload(field, "", []),
                **_final(event, calls, started, load_ns),
            }
            yield _line(final)


def _payload(field: str, text: str, calls: list[ToolCall], thinking: str = "") -> dict[str, Any]:
    """The answer's fields: generate's `response` (and `thinking`), or chat's `message`."""
    if field == "response":
        return {"response": text, **({"thinking": thinking} if thinking else {})}
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if thinking:
        message["thinking"] = thinking
    if calls:
        # with the model's id, as Ollama sends it: the client sends it back, and the next
        # turn's template renders what the model wrote
        message["tool_calls"] = [
            {"id": call.id, "function": {"name": call.name, "arguments": call.arguments}}
            for call in calls
        ]
    return {"message": message}


def _final(
    completion: Completion, calls: list[ToolCall], started: int, load_ns: int
) -> dict[str, Any]:
    """The last object's fields: why it ended and Ollama's counts and durations (ns);
    `load_ns`: what the request waited for its model to load."""
    computed = completion.prompt_tokens - completion.cached_tokens
    prompt_ns = int(computed / completion.prompt_tps * 1e9) if completion.prompt_tps else 0
    eval_ns = (
        int(completion.generation_tokens / completion.generation_tps * 1e9)
        if completion.generation_tps
        else 0
    )
    return {
        "done": True,
        "done_reason": "length" if completion.finish_reason == "length" else "stop",
        "total_duration": time.perf_counter_ns() - started,
        "load_duration": load_ns,
        "prompt_eval_count": completion.prompt_tokens,
        "prompt_eval_duration": prompt_ns,
        "eval_count": completion.generation_tokens,
        "eval_duration": eval_ns,
    }


def _unloaded(request: Request, body: Any, field: str, payload: Any) -> dict[str, Any]:
    """Ollama's unload (`keep_alive` zero, nothing to generate): the model unloads when idle
    and is never loaded for it (`models.served.unload_named`)."""
    name = unload_named(request, body.model or None)
    return _loaded(body.model or ollama_name(name), "unload", field, payload)


def _loaded(model: str, reason: str, field: str, payload: Any) -> dict[str, Any]:
    """The answer to a request with nothing to generate: a load, or an unload, as Ollama
    answers them."""
    return {**_head(model), field: payload, "done": True, "done_reason": reason}


def _head(model: str) -> dict[str, Any]:
    return {"model": model, "created_at": _timestamp(time.time())}


def _line(body: dict[str, Any]) -> str:
    return json.dumps(body, ensure_ascii=False) + "\n"


def _error_line(error: ApiError) -> str:
    return _line({"error": error.message})


def _name(ctx: ServerContext) -> str:
    return ollama_name(ctx.model_name)


def _check_served(name: str, ctx: ServerContext) -> None:
    """One model served: only its own name (several: the request's name chose, or was a 404
    listing them, alias patterns included)."""
    if len(ctx.models.resident) == 1 and ollama_name(name) != _name(ctx):
        raise ApiError(
            404,
            f"model '{name}' not found; this server serves '{_name(ctx)}' only (start "
            "mlxkv serve -m ... for another)",
        )


def _model_entry(ctx: ServerContext) -> dict[str, Any]:
    """A model as `/api/tags` lists it: its weights' bytes and digest as last loaded (a model
    not loaded yet: its weights' expected bytes, no digest), as Ollama lists a model's size on
    disk (its cache budget is in `/api/ps`)."""
    facts, loader = ctx.resident.facts, ctx.resident.loader
    return {
        "name": _name(ctx),
        "model": _name(ctx),
        "modified_at": _timestamp(ctx.created),
        "size": facts.weights_bytes if facts else loader.weights_bytes if loader else 0,
        "digest": "" if facts is None else facts.digest,
        "details": _details(ctx),
    }


def _details(ctx: ServerContext) -> dict[str, Any]:
    family = _model_type(ctx)
    return {
        "parent_model": "",
        "format": "safetensors",
        "family": family,
        "families": [family],
        "parameter_size": "",
        "quantization_level": "",
    }


def _model_type(ctx: ServerContext) -> str:
    """Its config's `model_type`, as last loaded or read before its first load."""
    facts, before = ctx.resident.facts, ctx.resident.template_facts
    if facts is not None:
        return facts.config.get("model_type") or "unknown"
    return (before.model_type if before is not None else "") or "unknown"


def _timestamp(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


# What a stream sends while its model loads (`models.streams`): NDJSON has no keep-alive;
# the headers go out at once.
STREAMS = {
    path: StreamShape(
        _error_line, keepalive=None, media_type="application/x-ndjson", streams_by_default=True
    )
    for path in ("/api/chat", "/api/generate")
}
