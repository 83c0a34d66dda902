"""OpenAI's Responses API: `POST /v1/responses`, plain and as server-sent events, enough for
Codex CLI (`wire_api = "responses"`).

Owns the translation between a Responses body and a `Turn`, and the events: response.created,
response.in_progress, response.output_item.added/done, response.content_part.added/done,
response.reasoning_text.delta/done, response.output_text.delta/done,
response.function_call_arguments.delta/done, then response.completed (response.incomplete
when max_output_tokens cut the reply; response.failed); a `background` response's created
`queued` with response.queued, made on a task of its own (`background`).
`usage.input_tokens_details.cached_tokens` is what the prompt cache supplied. The model's
thinking is a `reasoning` item (its text as `reasoning_text` content, no summary, as
OpenAI's open-weight models and vLLM give it) before the message; sent back in `input`, or
kept for `previous_response_id`, it is the chat template's `reasoning_content` for the
assistant turn that follows it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request

from mlxkv.runner.results import Completion
from mlxkv.server.early_events import marking_waits
from mlxkv.server.errors import ApiError, openai_error
from mlxkv.server.models.streams import StreamShape
from mlxkv.server.reply.start import start_turn
from mlxkv.server.reply.tool_calls import ToolCall
from mlxkv.server.reply.turn import (
    WAITING,
    ReasoningDelta,
    TextDelta,
    Turn,
    collect,
)
from mlxkv.server.responses_api.background import background_responses, check_background
from mlxkv.server.responses_api.conversations import ConversationClaim, held_conversations
from mlxkv.server.responses_api.history import request_prompt, stored_responses
from mlxkv.server.responses_api.items import listed_item
from mlxkv.server.responses_api.output import (
    add_text,
    as_messages,
    call_item,
    content_part,
    cut_item,
    empty_item,
    item_end,
    item_kind,
    new_item,
    output_items,
    usage,
    usage_so_far,
    was_cut,
)
from mlxkv.server.responses_api.protocol import NamedFunction, ResponsesRequest
from mlxkv.server.responses_api.saved import saved_to_disk
from mlxkv.server.state import Context, event_stream, replay_stream, sse

logger = logging.getLogger(__name__)
router = APIRouter()
# What keeps a response that ended (stored, added to its conversation, in their files).
_Remember = Callable[[dict[str, Any]], Awaitable[None]]


@router.post("/v1/responses")
async def create_response(
    body: ResponsesRequest, request: Request, ctx: Context, claim: ConversationClaim
):
    check_background(body.background, body.store)
    conversation, items, messages = request_prompt(body, request)
    if conversation is not None:  # before any wait: nothing else reads it meanwhile
        claim.take(held_conversations(request), conversation)
    turn = await start_turn(
        request,
        body.system_messages() + messages,
        tools=body.template_tools(),
        # No max_output_tokens means no limit but the window, as OpenAI reads it: Codex sends
        # none and takes a reply cut short (response.incomplete) as a failed turn.
        sampling=body.sampling(ctx.worker.runner.max_context),
        cache_key=body.prompt_cache_key,
        max_tokens_asked=body.max_output_tokens is not None,
        cache_salt=body.cache_salt,
        forced=body.forced_call(),
        switches=body.template_switches(),
        top_logprobs=body.logprobs_asked(),
    )
    if body.background:  # the claim is released as the response ends, not as the request does
        claim = claim.detach()
    response = _Response(body, ctx.model_name, conversation, turn)
    listed = [listed_item(item.model_dump(exclude_none=True)) for item in items]

    async def remember(final: dict[str, Any]) -> None:
        """Stores the response (`store`) and adds it to its conversation, once it ended (a
        conversation deleted or dropped meanwhile takes nothing: the reply stands), which
        the next response may then take; returns once they are in their files (`saved`)."""
        if body.store:
            stored = messages + as_messages(final["output"])
            stored_responses(request).put(
                stored, final, listed, salt=body.cache_salt, previous=body.previous_response_id
            )
        if conversation is not None:
            try:
                held = held_conversations(request)
                added = listed + final["output"]
                held.add(conversation, added, body.cache_salt, skip_held=True)
            except ApiError as error:
                logger.warning("responses: %s kept out of its conversation: %s", response.id, error)
            finally:
                claim.release()
        await saved_to_disk(request)

    if body.background or body.stream:
        events = _response_events(turn, response, remember, request.scope)
        if not body.background:
            return event_stream(events, turn, response.failed_event)
        background = background_responses(request)
        run = background.start(request, response, turn, events, claim, body.cache_salt, listed)
        await saved_to_disk(request)
        return replay_stream(run.read()) if body.stream else response.latest
    events, completion = await collect(turn, request)
    output = output_items(events, completion)
    final = response.body(output, completion, reasoning_tokens=turn.reasoning_tokens)
    if completion.finish_reason != "cancelled":  # else its client left: no half turn kept
        await remember(final)
    return final


class _Response:
    """What every event of one response shares, and the response object itself."""

    def __init__(self, request: ResponsesRequest, model: str, conversation: str | None, turn: Turn):
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.model = model
        self.request = request
        self.conversation = conversation  # the id of the one it is added to
        self._turn = turn
        self._sequence = -1  # OpenAI numbers a response's events from 0
        # the response object as its last event carried it (a background one's, polled)
        self.latest = self.body([], None, "queued") if request.background else {}
        # the output items written so far, the one being written last (`_response_events`)
        self.written: Callable[[], list[dict[str, Any]]] = list

    def body(
        self,
        output: list[dict[str, Any]],
        completion: Completion | None,
        status: str = "",
        reasoning_tokens: int = 0,
    ) -> dict[str, Any]:
        request = self.request
        choice = request.tool_choice
        incomplete = was_cut(completion)
        if not status and completion is not None and completion.finish_reason == "cancelled":
            status = "cancelled"  # a background response's (others have no reader left)
        status = status or ("incomplete" if incomplete else "completed")
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": output,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "parallel_tool_calls": request.parallel_tool_calls,
            "previous_response_id": request.previous_response_id,
            # as OpenAI's, the conversation it was added to
            **({"conversation": {"id": self.conversation}} if self.conversation else {}),
            "store": request.store,
            # a named function as a dict: streamed events go through json.dumps
            "tool_choice": choice.model_dump()
            if isinstance(choice, NamedFunction)
            else choice or "auto",
            **request.settings(),
            "completed_at": int(time.time()) if status == "completed" else None,
            "usage": usage(completion, reasoning_tokens) if completion is not None else None,
        }

    def event(self, kind: str, **fields: Any) -> str:
        self._sequence += 1
        self.latest = fields.get("response", self.latest)
        return sse({"type": kind, "sequence_number": self._sequence, **fields}, kind)

    def cut_short(self) -> list[dict[str, Any]]:
        """What it wrote, the item being written `incomplete`: the output of a response that
        ended before its reply did (failed, cancelled)."""
        return [cut_item(i) if i["status"] == "in_progress" else i for i in self.written()]

    def failed_event(self, error: ApiError) -> str:
        failed = self.body(self.cut_short(), None, status="failed")
        failed["usage"] = usage_so_far(self._turn)
        failed["error"] = {"code": _error_code(error), "message": error.message}
        return self.event("response.failed", response=failed)


async def _response_events(
    turn: Turn, response: _Response, remember: _Remember, scope: dict[str, Any]
) -> AsyncIterator[str]:
    """response.created and response.in_progress (`_opening_events`), then the output items'
    events and response.completed (or response.incomplete). A first token late for Codex's
    watchdog (`early_events`: the request of `scope` arrived long before) finds
    response.in_progress sent again every keep-alive interval meanwhile, and so does a tool
    call long in the writing (held until whole): Codex does not count SSE comments."""
    in_progress = response.body([], None, "in_progress")
    async for line in _opening_events(turn, response, in_progress):
        yield line
    output: list[dict[str, Any]] = []
    open_item: dict[str, Any] | None = None  # the reasoning or message item being streamed
    response.written = lambda: output + ([] if open_item is None else [open_item])
    async for event in marking_waits(turn, scope):
        if event is WAITING:
            yield response.event("response.in_progress", response=in_progress)
        elif isinstance(event, TextDelta | ReasoningDelta) and event.text:
            kind = item_kind(event)
            if open_item is not None and open_item["type"] != kind:
                for line in _close_item(response, open_item, len(output), "completed"):
                    yield line
                output.append(open_item)
                open_item = None
            if open_item is None:
                open_item = new_item(kind, "", "in_progress")
                for line in _open_item(response, open_item, len(output)):
                    yield line
            logprobs = add_text(open_item, event)
            yield _text_delta(response, open_item, len(output), event.text, logprobs)
        elif isinstance(event, TextDelta) and open_item is not None:  # tokens that showed none
            add_text(open_item, event)
        elif isinstance(event, ToolCall):
            if open_item is not None:
                for line in _close_item(response, open_item, len(output), "completed"):
                    yield line
                output.append(open_item)
                open_item = None
            item = call_item(event)
            for line in _function_call(response, item, len(output)):
                yield line
            output.append(item)
        elif isinstance(event, Completion):
            if open_item is not None:
                for line in _close_item(response, open_item, len(output), item_end(event)):
                    yield line
                output.append(open_item)
                open_item = None
            final = response.body(output, event, reasoning_tokens=turn.reasoning_tokens)
            if final["status"] == "cancelled":  # kept to be read, not as a turn; no event
                response.latest = final
                return
            await remember(final)
            # OpenAI ends a reply cut by max_output_tokens with response.incomplete
            kind = (
                "response.incomplete" if final["status"] == "incomplete" else "response.completed"
            )
            yield response.event(kind, response=final)


async def _opening_events(
    turn: Turn, response: _Response, in_progress: dict[str, Any]
) -> AsyncIterator[str]:
    """response.created and response.in_progress at once; a background response's created
    `queued` (response.queued), and in progress once its generation has started."""
    if response.request.background:
        yield response.event("response.created", response=response.latest)
        yield response.event("response.queued", response=response.latest)
        if await asyncio.shield(turn.matched) is None:  # it ended before it started
            return
    else:
        yield response.event("response.created", response=in_progress)
    yield response.event("response.in_progress", response=in_progress)


def _open_item(response: _Response, item: dict[str, Any], index: int) -> list[str]:
    return [
        response.event("response.output_item.added", output_index=index, item=empty_item(item)),
        response.event(
            "response.content_part.added",
            item_id=item["id"],
            output_index=index,
            content_index=0,
            part=content_part(item["type"], ""),
        ),
    ]


def _text_delta(
    response: _Response,
    item: dict[str, Any],
    index: int,
    text: str,
    logprobs: list[dict[str, Any]],
) -> str:
    fields = {"item_id": item["id"], "output_index": index, "content_index": 0, "delta": text}
    if item["type"] == "reasoning":
        return response.event("response.reasoning_text.delta", **fields)
    return response.event("response.output_text.delta", **fields, logprobs=logprobs)


def _close_item(response: _Response, item: dict[str, Any], index: int, status: str) -> list[str]:
    item["status"] = status
    text = item["content"][0]["text"]
    where = {"item_id": item["id"], "output_index": index, "content_index": 0}
    if item["type"] == "reasoning":
        done = response.event("response.reasoning_text.done", **where, text=text)
    else:
        logprobs = item["content"][0]["logprobs"]
        done = response.event("response.output_text.done", **where, text=text, logprobs=logprobs)
    return [
        done,
        response.event("response.content_part.done", **where, part=item["content"][0]),
        response.event("response.output_item.done", output_index=index, item=item),
    ]


def _function_call(response: _Response, item: dict[str, Any], index: int) -> list[str]:
    added = {**item, "status": "in_progress", "arguments": ""}
    return [
        response.event("response.output_item.added", output_index=index, item=added),
        response.event(
            "response.function_call_arguments.delta",
            item_id=item["id"],
            output_index=index,
            delta=item["arguments"],
        ),
        response.event(
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=index,
            arguments=item["arguments"],
        ),
        response.event("response.output_item.done", output_index=index, item=item),
    ]


def _early_error_event(error: ApiError) -> str:
    """OpenAI's stream `error` event, for a stream that fails before its response exists."""
    event = {"type": "error", "code": _error_code(error), "message": error.message}
    return sse({**event, "param": error.param, "sequence_number": 0}, "error")


def _error_code(error: ApiError) -> str:
    """A Responses error's `code`: the error's own, else the type its status gets."""
    return error.code or openai_error(error)["type"]


# What a stream sends while its model loads (`models.streams`).
STREAMS = {"/v1/responses": StreamShape(_early_error_event)}
