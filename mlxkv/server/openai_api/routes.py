"""OpenAI's API: `/v1/models`, `/v1/chat/completions` and `/v1/completions`, plain and as
server-sent events.

Owns the translation between OpenAI's bodies and a `Turn`; the request schemas are in
`protocol.py`. `usage.prompt_tokens_details.cached_tokens` is the number of prompt
tokens the prompt cache supplied (not computed again). A chat reply's thinking is
`reasoning_content` (DeepSeek's and vLLM's name; `reasoning` too, with the same text, as vLLM
keeps both and mlx-lm's server sends that one), in the message and in stream deltas.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from mlxkv.runner.results import Completion
from mlxkv.server.early_events import marking_waits
from mlxkv.server.errors import ApiError, openai_error
from mlxkv.server.models.streams import StreamShape
from mlxkv.server.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from mlxkv.server.protocol import openai_logprobs
from mlxkv.server.reply.choices import Choices, combined, start_choices
from mlxkv.server.reply.start import PreparedTurn, prepare_turn
from mlxkv.server.reply.tool_calls import ToolCall
from mlxkv.server.reply.turn import (
    WAITING,
    Event,
    ReasoningDelta,
    TextDelta,
    TokenInfo,
    Turn,
    collect_each,
)
from mlxkv.server.state import Context, ServerContext, event_stream, interleaved, sse

router = APIRouter()


@router.get("/v1/models")
async def list_models(ctx: Context) -> dict[str, Any]:
    return {"object": "list", "data": [_model_object(each) for each in ctx.each_model()]}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, ctx: Context) -> dict[str, Any]:
    """The listed object of the model `model_id` names, as a request's `model` may name it
    (an Ollama name, an alias): the object has the served name, as OpenAI's has the model's."""
    name = ctx.models.find(model_id)
    if name is None:
        message = f"model '{model_id}' not found; this server serves: {ctx.models.listed}"
        raise ApiError(404, message, code="model_not_found", param="model")
    return next(_model_object(each) for each in ctx.each_model() if each.model_name == name)


def _model_object(each: ServerContext) -> dict[str, Any]:
    model = {"id": each.model_name, "object": "model", "created": each.created}
    model["owned_by"] = "mlxkv"
    # beyond OpenAI's fields, as vLLM adds `max_model_len`: what clients may ask of it
    model["capabilities"] = each.capabilities.names()
    model["tool_call_format"] = each.capabilities.tool_call_format
    return model


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, ctx: Context):
    max_tokens = body.max_completion_tokens
    if max_tokens is None:
        max_tokens = body.max_tokens

    _check_choices(ctx, body.n)  # before any image is fetched
    prepared = await prepare_turn(
        request,
        body.chat_messages(),
        tools=body.template_tools(),
        sampling=body.sampling(max_tokens, ctx.default_max_tokens),
        top_logprobs=body.top_logprobs_count(),
        cache_key=body.prompt_cache_key,
        max_tokens_asked=max_tokens is not None,
        cache_salt=body.cache_salt,
        forced=body.forced_call(),
        switches=body.template_switches(),
    )
    choices = await start_choices([prepared], body.n)
    reply = _Reply(ctx.model_name, "chatcmpl", "chat.completion")
    if body.stream:
        events = _chat_events(choices, reply, body.include_usage, request.scope)
        return event_stream(events, choices, _error_event)
    collected = await collect_each(choices.turns, request)
    bodies = [_chat_choice(i, *each, body.logprobs) for i, each in enumerate(collected)]
    usage = combined([completion for _, completion in collected], body.n)
    return reply.body(bodies, usage=_usage(usage))


def _chat_choice(
    index: int, events: list[Event], completion: Completion, logprobs: bool | None
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": _text(events)}
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    if reasoning:
        message.update(_reasoning(reasoning))
    calls = [event for event in events if isinstance(event, ToolCall)]
    if calls:
        message["tool_calls"] = [_tool_call(call) for call in calls]
        message["content"] = message["content"] or None
    return {
        "index": index,
        "message": message,
        "logprobs": {"content": _chat_logprobs(events)} if logprobs else None,
        "finish_reason": _finish_reason(completion, calls),
    }


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, ctx: Context):
    """Text completions of one prompt or several, `n` choices each, indexed by prompt then
    choice (OpenAI's and vLLM's order); with `echo`, each choice's text begins with its
    prompt's, and with `logprobs` too, its log-probabilities with the prompt's own (how
    lm-evaluation-harness scores a continuation)."""
    prompts = body.prompts()
    _check_choices(ctx, len(prompts) * body.n)
    settings = {
        "tools": None,
        "sampling": body.sampling(body.max_tokens, ctx.default_max_tokens),
        "top_logprobs": body.logprobs,
        "prompt_logprobs": body.logprobs if body.echo else None,
        "max_tokens_asked": "max_tokens" in body.model_fields_set,
        "cache_salt": body.cache_salt,
        "split_thinking": False,  # a text completion is the text as generated
    }
    prepared = [await prepare_turn(request, prompt, **settings) for prompt in prompts]
    choices = await start_choices(prepared, body.n)
    echoes = [_echo(each) if body.echo else "" for each in prepared for _ in range(body.n)]
    reply = _Reply(ctx.model_name, "cmpl", "text_completion")
    if body.stream:
        events = _completion_events(choices, echoes, reply, body, request.scope)
        return event_stream(events, choices, _error_event)
    collected = await collect_each(choices.turns, request)
    bodies = [
        {
            "index": index,
            "text": echoes[index] + _text(events),
            "logprobs": None
            if body.logprobs is None
            else _legacy_logprobs(events, turn, tail=turn.end_logprob),
            "finish_reason": _finish_reason(completion, []),
        }
        for index, ((events, completion), turn) in enumerate(
            zip(collected, choices.turns, strict=True)
        )
    ]
    usage = combined([completion for _, completion in collected], body.n)
    return reply.body(bodies, usage=_usage(usage))


def _echo(prepared: PreparedTurn) -> str:
    """A prompt's text as `echo` gives it back: as sent, or its token ids decoded."""
    prompt = prepared.prompt
    return prompt if isinstance(prompt, str) else prepared.worker.runner.tokenizer.decode(prompt)


def _check_choices(ctx: ServerContext, num_choices: int) -> None:
    if ctx.worker is not None:  # a POST's model is loaded
        ctx.worker.check_places(num_choices)


class _Reply:
    """The fields every response and chunk of one request share."""

    def __init__(self, model: str, id_prefix: str, kind: str):
        self.id = f"{id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.kind = kind

    def body(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        head = {"id": self.id, "object": self.kind, "created": self.created, "model": self.model}
        return {**head, "choices": choices, **extra}


async def _chat_events(
    choices: Choices, reply: _Reply, include_usage: bool, scope: dict[str, Any]
) -> AsyncIterator[str]:
    """Each choice's role chunk at once, then the replies' chunks as they come; a wait the
    client's watchdog would count as a stall (`early_events`: langchain-openai's
    `stream_chunk_timeout`, 120 s, counts only parsed chunks) sends a chunk of empty content."""
    reply.kind = "chat.completion.chunk"

    def chunk(index: int, delta: dict, finish: str | None = None, logprobs: Any = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return sse(reply.body([choice]))

    turns = choices.turns
    for index in range(len(turns)):
        yield chunk(index, {"role": "assistant", "content": ""})
    calls: list[list[ToolCall]] = [[] for _ in turns]
    ended: dict[int, Completion] = {}
    async for index, event in interleaved([marking_waits(turn, scope) for turn in turns]):
        if event is WAITING:
            yield chunk(index, {"content": ""})
        elif isinstance(event, TextDelta | ReasoningDelta) and (event.text or event.logprobs):
            logprobs = {"content": openai_logprobs(event.logprobs)} if event.logprobs else None
            if isinstance(event, ReasoningDelta):
                yield chunk(index, _reasoning(event.text), logprobs=logprobs)
            else:
                yield chunk(index, {"content": event.text}, logprobs=logprobs)
        elif isinstance(event, ToolCall):
            call = {"index": len(calls[index]), **_tool_call(event)}
            yield chunk(index, {"tool_calls": [call]})
            calls[index].append(event)
        elif isinstance(event, Completion):
            yield chunk(index, {}, finish=_finish_reason(event, calls[index]))
            ended[index] = event
    for event in _stream_end(reply, ended, choices, include_usage):
        yield event


async def _completion_events(
    choices: Choices,
    echoes: list[str],
    reply: _Reply,
    body: CompletionRequest,
    scope: dict[str, Any],
) -> AsyncIterator[str]:
    """Each choice's echoed prompt (at once; with its log-probabilities, once they are
    known: with the choice's first event), then its text chunks as they come; a long wait
    (`early_events`) sends one of empty text. A token's `text_offset` runs on through its
    choice, as in one response (each chunk's began at 0)."""
    at = [0] * len(choices.turns)  # characters of each choice's tokens so far

    def chunk(index: int, text: str, logprobs: Any = None, finish: str | None = None) -> str:
        if logprobs is not None:
            logprobs["text_offset"] = [at[index] + offset for offset in logprobs["text_offset"]]
            at[index] += sum(len(token) for token in logprobs["tokens"])
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return sse(reply.body([choice]))

    scored = body.logprobs is not None
    for index, echo in enumerate(echoes):
        if echo and not scored:
            yield chunk(index, echo)
    echoing = {index for index, echo in enumerate(echoes) if echo and scored}
    ended: dict[int, Completion] = {}
    turns = [marking_waits(turn, scope) for turn in choices.turns]
    async for index, event in interleaved(turns):
        if event is not WAITING and index in echoing:
            echoing.discard(index)
            yield chunk(index, echoes[index], _legacy_logprobs([], choices.turns[index]))
        if event is WAITING:
            yield chunk(index, "")
        elif isinstance(event, TextDelta) and (event.text or event.logprobs):
            logprobs = _legacy_logprobs([event]) if scored else None
            yield chunk(index, event.text, logprobs)
        elif isinstance(event, Completion):
            end = choices.turns[index].end_logprob if scored else None
            logprobs = _legacy_logprobs([], tail=end) if end else None
            yield chunk(index, "", logprobs, finish=_finish_reason(event, []))
            ended[index] = event
    for event in _stream_end(reply, ended, choices, body.include_usage):
        yield event


def _stream_end(
    reply: _Reply, ended: dict[int, Completion], choices: Choices, include_usage: bool
) -> list[str]:
    """The usage chunk once every choice has ended (`stream_options.include_usage`; `ended`
    by index), then the stream's end."""
    num_turns = len(choices.turns)
    if not include_usage or len(ended) < num_turns:
        return [sse("[DONE]")]
    usage = combined([ended[index] for index in range(num_turns)], choices.num_choices)
    return [sse(reply.body([], usage=_usage(usage))), sse("[DONE]")]


def _error_event(error: ApiError) -> str:
    return sse({"error": openai_error(error)})


def _text(events: list[Event]) -> str:
    return "".join(event.text for event in events if isinstance(event, TextDelta))


def _reasoning(text: str) -> dict[str, str]:
    return {"reasoning_content": text, "reasoning": text}


def _tool_call(call: ToolCall) -> dict[str, Any]:
    function = {"name": call.name, "arguments": call.arguments_json}
    return {"id": call.id, "type": "function", "function": function}


def _finish_reason(completion: Completion, calls: list[ToolCall]) -> str:
    if calls and completion.finish_reason == "stop":
        return "tool_calls"
    return "length" if completion.finish_reason == "length" else "stop"


def _usage(completion: Completion) -> dict[str, Any]:
    return {
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion.generation_tokens,
        "total_tokens": completion.prompt_tokens + completion.generation_tokens,
        "prompt_tokens_details": {"cached_tokens": completion.cached_tokens},
    }


def _chat_logprobs(events: list[Event]) -> list[dict[str, Any]]:
    deltas = (e for e in events if isinstance(e, TextDelta | ReasoningDelta))
    return openai_logprobs(t for e in deltas for t in e.logprobs)


def _legacy_logprobs(
    events: list[Event], echoed: Turn | None = None, tail: TokenInfo | None = None
) -> dict[str, Any]:
    """The completions endpoint's older shape: parallel lists per token; first the prompt's
    own where the turn of an `echoed` prompt scored it (its first token's null), last the
    EOS that ended the reply (`tail`: a generated token, counted in the usage; without it,
    lm-evaluation-harness's `token_logprobs[ctxlen:-1]` dropped the continuation's last)."""
    tokens = [t for e in events if isinstance(e, TextDelta) for t in e.logprobs]
    if echoed is not None and echoed.prompt_logprobs is not None:
        tokens = echoed.prompt_logprobs + tokens
    if tail is not None:
        tokens = [*tokens, tail]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token.text)
    return {
        "tokens": [t.text for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [None if t.logprob is None else dict(t.top) for t in tokens],
        "text_offset": offsets,
    }


# What a stream sends while its model loads (`models.streams`).
STREAMS = {path: StreamShape(_error_event) for path in ("/v1/chat/completions", "/v1/completions")}
