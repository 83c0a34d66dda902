"""A Responses reply's output items, as OpenAI's: a message (its text as `output_text`, with
log-probabilities asked for), a reasoning item (its text as `reasoning_text`), a function
call; the status each ends with; and the output as the chat messages the next turn renders,
and the usage it reports."""

from __future__ import annotations

import json
import uuid
from typing import Any

from mlxkv.runner.results import Completion
from mlxkv.server.protocol import openai_logprobs
from mlxkv.server.reply.tool_calls import ToolCall
from mlxkv.server.reply.turn import Event, ReasoningDelta, TextDelta, Turn


def item_end(completion: Completion) -> str:
    """The status of the item a reply ended in: cut where max_output_tokens or a cancel cut
    it."""
    cut = was_cut(completion) or completion.finish_reason == "cancelled"
    return "incomplete" if cut else "completed"


def cut_item(item: dict[str, Any]) -> dict[str, Any]:
    """An item being written, as a response that ended meanwhile holds it."""
    return {**item, "status": "incomplete"}


def output_items(events: list[Event], completion: Completion | None) -> list[dict[str, Any]]:
    """A whole reply's output items, in the order the streamed ones come: runs of thinking
    or text joined into one reasoning or message item, each tool call its own; the last
    `incomplete` when its text was cut (a call is only ever whole)."""
    output: list[dict[str, Any]] = []
    for event in events:
        if isinstance(event, ToolCall):
            output.append(call_item(event))
        elif isinstance(event, TextDelta | ReasoningDelta) and event.text:
            kind = item_kind(event)
            if not output or output[-1]["type"] != kind:
                output.append(new_item(kind, ""))
            add_text(output[-1], event)
        elif isinstance(event, TextDelta) and output and output[-1]["type"] == "message":
            add_text(output[-1], event)  # the last tokens, which showed no text
    if output and output[-1]["type"] != "function_call" and was_cut(completion):
        output[-1]["status"] = "incomplete"
    return output


def was_cut(completion: Completion | None) -> bool:
    """Whether max_output_tokens (or the window) cut the reply: the response and the item
    it cut are `incomplete`, as OpenAI sends them (the item in response.output_item.done
    too); the items before it are whole."""
    return completion is not None and completion.finish_reason == "length"


def item_kind(event: TextDelta | ReasoningDelta) -> str:
    return "reasoning" if isinstance(event, ReasoningDelta) else "message"


def add_text(item: dict[str, Any], event: TextDelta | ReasoningDelta) -> list[dict[str, Any]]:
    """Adds `event`'s text to `item`, and its tokens' log-probabilities (asked with
    `include`) to a message's text; returns those."""
    part = item["content"][0]
    part["text"] += event.text
    logprobs = openai_logprobs(event.logprobs) if item["type"] == "message" else []
    if logprobs:
        part["logprobs"].extend(logprobs)
    return logprobs


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def content_part(item_type: str, text: str) -> dict[str, Any]:
    """The content part a message (output text) or reasoning item (its text) holds."""
    if item_type == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def new_item(kind: str, text: str, status: str = "completed") -> dict[str, Any]:
    """A message item, or a reasoning item; both hold their text in `content[0]`."""
    if kind == "reasoning":
        head = {"id": item_id("rs"), "type": "reasoning", "status": status, "summary": []}
    else:
        head = {"id": item_id("msg"), "type": "message", "status": status, "role": "assistant"}
    return {**head, "content": [content_part(kind, text)]}


def empty_item(item: dict[str, Any]) -> dict[str, Any]:
    return {**item, "content": []}


def call_item(call: ToolCall) -> dict[str, Any]:
    return {
        "id": item_id("fc"),
        "type": "function_call",
        "status": "completed",
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments_json,
    }


def as_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as the chat messages the next turn's template renders."""
    text = "".join(i["content"][0]["text"] for i in output if i["type"] == "message")
    reasoning = "".join(i["content"][0]["text"] for i in output if i["type"] == "reasoning")
    calls = [
        {
            "id": i["call_id"],
            "type": "function",
            "function": {"name": i["name"], "arguments": json.loads(i["arguments"])},
        }
        for i in output
        if i["type"] == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return [message]


def usage(completion: Completion, reasoning_tokens: int = 0) -> dict[str, Any]:
    return _usage(
        completion.prompt_tokens,
        completion.cached_tokens,
        completion.generation_tokens,
        reasoning_tokens,
    )


def usage_so_far(turn: Turn) -> dict[str, Any] | None:
    """The usage of a reply that ended before its Completion (failed): its prompt's and the
    tokens generated until then; None where its prompt was not matched yet."""
    prompt = turn.prompt
    if prompt is None:
        return None
    used = (prompt.prompt_tokens, prompt.cached_tokens, turn.generated_tokens)
    return _usage(*used, turn.reasoning_tokens)


def _usage(
    prompt_tokens: int, cached_tokens: int, output_tokens: int, reasoning_tokens: int
) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": cached_tokens,
            "cache_write_tokens": 0,  # nothing is billed for writing (Anthropic's usage too)
        },
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + output_tokens,
    }
