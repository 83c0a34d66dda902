"""Anthropic's Messages API: `/v1/messages` (plain and streamed with the standard event
sequence) and `/v1/messages/count_tokens`.

Owns the translation between Anthropic's bodies and a `Turn`; schemas are in
`protocol.py`. Usage follows Anthropic's definitions: `cache_read_input_tokens` are
the prompt tokens the prompt cache supplied, `input_tokens` the rest (computed now), and
`cache_creation_input_tokens` is 0 (nothing is billed for writing the cache); streamed, they
come in `message_start` as they do in `message_delta`. The model's
thinking comes as `thinking` blocks (streamed as `thinking_delta`s) before the text, with an
empty `signature` (nothing here signs it); sent back in a later turn, a thinking block is
the chat template's `reasoning_content` for that turn.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from mlxkv.runner.results import Completion, PromptUsage
from mlxkv.server.anthropic_api.diagnostics import (
    PromptRecord,
    PromptRecords,
    content_hash,
    diagnose,
    make_locator,
    prompt_records,
)
from mlxkv.server.anthropic_api.protocol import MessagesRequest, PromptFields
from mlxkv.server.anthropic_api.threads import message_threads
from mlxkv.server.anthropic_api.tool_ids import client_id
from mlxkv.server.early_events import marking_waits, until_due
from mlxkv.server.errors import ApiError, anthropic_error, bad_input_error
from mlxkv.server.images import fetched_images
from mlxkv.server.models.streams import StreamShape
from mlxkv.server.reply.start import start_turn
from mlxkv.server.reply.tool_calls import ToolCall
from mlxkv.server.reply.turn import (
    WAITING,
    Event,
    ReasoningDelta,
    TextDelta,
    Turn,
    collect,
)
from mlxkv.server.state import Context, ServerContext, event_stream, sse

router = APIRouter()


_USAGE_FIELDS = (
    "input_tokens",
    "cache_creation_input_tokens",
    "cache_read_input_tokens",
    "output_tokens",
)
# Sent while a stream has nothing else to say (a long prefill, a wait in the queue).
_PING = sse({"type": "ping"}, "ping")


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request, ctx: Context):
    threads = message_threads(request)
    body = threads.resume(body)  # a thread's continue: the whole conversation
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    # Before the request runs: what the cache holds for the prompt now.
    diagnostics = None
    if body.diagnostics is not None:
        diagnostics = await _diagnostics(body, ctx, prompt_records(request), message_id)
    turn = await start_turn(
        request,
        body.chat_messages(),
        tools=body.template_tools(),
        sampling=body.sampling(),
        cache_salt=body.cache_salt,
        forced=body.forced_call(),
        switches=body.template_switches(),
    )
    head = _message_head(message_id, ctx.model_name, [])
    if body.diagnostics is not None:
        head["diagnostics"] = diagnostics
    prewarm = body.max_tokens == 0
    if body.stream:
        early_kind = _early_kind(body, turn)
        keep = functools.partial(threads.keep, message_id, body)
        events = _message_events(turn, head, early_kind, request.scope, prewarm, keep)
        return event_stream(events, turn, _error_event, keepalive=_PING)
    events, completion = await collect(turn, request)
    calls = [event for event in events if isinstance(event, ToolCall)]
    content = _blocks(events)
    threads.keep(message_id, body, content)
    return {
        **head,
        "content": content,
        **_stop(completion, calls),
        "usage": _usage(completion, completion.generation_tokens, prewarm),
    }


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: PromptFields, request: Request, ctx: Context) -> dict[str, int]:
    body = message_threads(request).resume(body)  # a thread's continue: all of it
    runner = ctx.worker.runner
    messages = await fetched_images(body.chat_messages(), ctx.fetch_images)
    try:
        tokens = await run_in_threadpool(
            runner.encode,
            messages,
            tools=body.template_tools(),
            switches=body.template_switches(),
            cache_salt=body.cache_salt,
        )
    except ValueError as error:
        raise bad_input_error(error, ctx.model_name) from error
    return {"input_tokens": len(tokens)}


def _message_head(message_id: str, model: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
    }


def _blocks(events: list[Event]) -> list[dict[str, Any]]:
    """Content blocks: runs of thinking or text joined into one block, each tool call its
    own."""
    blocks: list[dict[str, Any]] = []
    for event in events:
        if isinstance(event, ToolCall):
            blocks.append(_tool_use(event))
        elif isinstance(event, TextDelta | ReasoningDelta) and event.text:
            kind, field = _TEXT_FIELDS[type(event)]
            if blocks and blocks[-1]["type"] == kind:
                blocks[-1][field] += event.text
            else:
                blocks.append(_text_block(kind, event.text))
    return blocks


# The block a text event goes into, and the block's field (and its delta's) for the text.
_TEXT_FIELDS = {TextDelta: ("text", "text"), ReasoningDelta: ("thinking", "thinking")}
_DELTA_TYPES = {"text": "text_delta", "thinking": "thinking_delta"}


def _text_block(kind: str, text: str) -> dict[str, Any]:
    if kind == "thinking":
        return {"type": "thinking", "thinking": text, "signature": ""}
    return {"type": "text", "text": text}


def _tool_use(call: ToolCall, arguments: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": client_id(call.id),
        "name": call.name,
        "input": call.arguments if arguments is None else arguments,
    }


def _stop(completion: Completion, calls: list[ToolCall]) -> dict[str, Any]:
    if calls and completion.finish_reason == "stop":
        reason = "tool_use"
    elif completion.stop_string is not None:
        reason = "stop_sequence"
    elif completion.finish_reason == "length":
        reason = "max_tokens"
    else:
        reason = "end_turn"
    return {"stop_reason": reason, "stop_sequence": completion.stop_string}


def _usage(
    prompt: PromptUsage | Completion | None, output_tokens: int, prewarm: bool
) -> dict[str, int]:
    """Anthropic's usage of a prompt (its tokens, those the cache supplied) and its reply's
    `output_tokens`; zeros for a prompt not matched yet. A pre-warm (`max_tokens: 0`) reports
    the prompt tokens it put in the cache as cache creation."""
    if prompt is None:
        return dict.fromkeys(_USAGE_FIELDS, 0)
    uncached = prompt.prompt_tokens - prompt.cached_tokens
    return {
        "input_tokens": 0 if prewarm else uncached,
        "cache_creation_input_tokens": uncached if prewarm else 0,
        "cache_read_input_tokens": prompt.cached_tokens,
        "output_tokens": output_tokens,
    }


async def _diagnostics(
    body: MessagesRequest, ctx: ServerContext, records: PromptRecords, message_id: str
) -> dict[str, Any] | None:
    """Records this prompt under `message_id`, and explains what the cache misses of the
    previous one (`diagnostics.previous_message_id`); None when it misses nothing."""
    runner = ctx.worker.runner
    messages, origins = body.chat_messages_with_origins()
    # as the request will encode it: its images' bytes, its salt's generated replies
    messages = await fetched_images(messages, ctx.fetch_images)
    tools = body.template_tools()
    encode = functools.partial(
        runner.encode,
        tools=tools,
        switches=body.template_switches(),
        cache_salt=body.cache_salt,
    )
    try:
        tokens = await run_in_threadpool(encode, messages)
    except ValueError as error:
        raise bad_input_error(error, ctx.model_name) from error
    system_hash, tools_hash = content_hash(body.system_text()), content_hash(tools)
    rendered = np.asarray(tokens, np.uint32)
    record = PromptRecord(tokens=rendered, system_hash=system_hash, tools_hash=tools_hash)
    previous_id = body.diagnostics.get("previous_message_id")
    reason = None
    if previous_id is not None:
        previous = records.get(previous_id) if isinstance(previous_id, str) else None
        held = runner.cached_prefix_tokens(tokens, body.cache_salt)
        on_disk = runner.stored_prefix_tokens(tokens, body.cache_salt)
        locate = make_locator(tokens, origins, lambda k: encode(messages[:k]))
        reason = await run_in_threadpool(diagnose, record, previous, held, locate, on_disk)
    records.put(message_id, record)
    return None if reason is None else {"cache_miss_reason": reason}


def _early_kind(body: MessagesRequest, turn: Turn) -> str:
    """The block a long prefill opens early: thinking where thinking may come (Anthropic's
    thinking blocks come first), else text; the reply continues in it or closes it empty."""
    disabled = (body.thinking or {}).get("type") == "disabled"
    return "thinking" if turn.may_think and not disabled else "text"


async def _message_events(
    turn: Turn,
    head: dict[str, Any],
    early_kind: str,
    scope: dict[str, Any],
    prewarm: bool,
    keep: Callable[[list[dict[str, Any]]], None],
) -> AsyncIterator[str]:
    """message_start once the prompt cache is matched (a long prefill then sends pings), with
    the prompt's usage as message_delta and a reply not streamed give it (the SDKs' final
    message, Claude Code's context meter read it there; zeros where the match is later than an
    early event), then content blocks, message_delta with the stop reason and usage,
    message_stop. A first token late for Claude Code's watchdog (`early_events`: the request
    of `scope` arrived long before) finds block 0 (`early_kind`) open, kept alive by empty
    deltas (its SDK drops `ping`); a tool call long in the writing, the open block kept alive
    so, or an empty text block opened before it. `keep` gets the reply's blocks (its thread)."""
    index, open_kind = 0, None  # the text or thinking block being streamed, if any
    shown: list[Event] = []  # the reply's text, thinking and calls
    usage = _usage(await until_due(turn.matched, scope), 0, prewarm)
    head = {**head, "stop_reason": None, "stop_sequence": None, "usage": usage}
    yield sse({"type": "message_start", "message": head}, "message_start")
    async for event in marking_waits(turn, scope):
        if event is WAITING:  # an empty delta, in an empty block if none is open
            if open_kind is None:  # thinking only first, as Anthropic's blocks come
                open_kind = early_kind if index == 0 else "text"
                yield _block_start(index, _text_block(open_kind, ""))
            yield _text_delta(index, open_kind, "")
        elif isinstance(event, TextDelta | ReasoningDelta) and event.text:
            shown.append(event)
            kind = _TEXT_FIELDS[type(event)][0]
            if open_kind != kind:
                if open_kind is not None:
                    yield _block_stop(index)
                    index += 1
                open_kind = kind
                yield _block_start(index, _text_block(kind, ""))
            yield _text_delta(index, kind, event.text)
        elif isinstance(event, ToolCall):
            if open_kind is not None:
                open_kind = None
                yield _block_stop(index)
                index += 1
            shown.append(event)
            yield _block_start(index, _tool_use(event, arguments={}))
            delta = {"type": "input_json_delta", "partial_json": event.arguments_json}
            yield sse(
                {"type": "content_block_delta", "index": index, "delta": delta},
                "content_block_delta",
            )
            yield _block_stop(index)
            index += 1
        elif isinstance(event, Completion):
            if open_kind is not None:
                yield _block_stop(index)
            usage = _usage(event, event.generation_tokens, prewarm)
            calls = [call for call in shown if isinstance(call, ToolCall)]
            body = {"type": "message_delta", "delta": _stop(event, calls), "usage": usage}
            yield sse(body, "message_delta")
            keep(_blocks(shown))
            yield sse({"type": "message_stop"}, "message_stop")


def _text_delta(index: int, kind: str, text: str) -> str:
    delta = {"type": _DELTA_TYPES[kind], kind: text}  # a delta's field is named as its block
    body = {"type": "content_block_delta", "index": index, "delta": delta}
    return sse(body, "content_block_delta")


def _error_event(error: ApiError) -> str:
    return sse({"type": "error", "error": anthropic_error(error)}, "error")


def _block_start(index: int, block: dict[str, Any]) -> str:
    body = {"type": "content_block_start", "index": index, "content_block": block}
    return sse(body, "content_block_start")


def _block_stop(index: int) -> str:
    return sse({"type": "content_block_stop", "index": index}, "content_block_stop")


# What a stream sends while its model loads (`models.streams`): pings, as during a prefill.
STREAMS = {"/v1/messages": StreamShape(_error_event, keepalive=_PING)}
