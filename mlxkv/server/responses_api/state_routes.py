"""The routes of what the Responses API keeps on the server. Conversations
(`/v1/conversations`: created with items and metadata, read, their metadata updated, deleted;
their items listed a page at a time, `order` and `after` as OpenAI's, added, read and deleted;
the store is `conversations`); a stored response read, its input items listed, deleted
(`history`); and the input tokens a response would take, counted before it is sent."""

from __future__ import annotations

import functools
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from mlxkv.server.errors import ApiError, bad_input_error
from mlxkv.server.images import fetched_images
from mlxkv.server.protocol import Lenient
from mlxkv.server.responses_api.conversations import checked_items, held_conversations
from mlxkv.server.responses_api.history import (
    named_conversation,
    prior_messages,
    resolve_references,
    stored_responses,
)
from mlxkv.server.responses_api.items import item_list
from mlxkv.server.responses_api.protocol import ResponsesRequest, chat_messages
from mlxkv.server.state import Context

router = APIRouter()


class ConversationBody(Lenient):
    items: list[Any] | None = None
    metadata: dict[str, str] | None = None


class ItemsBody(Lenient):
    items: list[Any] = Field(min_length=1)


@router.post("/v1/conversations")
async def create_conversation(body: ConversationBody, request: Request) -> dict[str, Any]:
    created = held_conversations(request).create(body.items or [], body.metadata or {})
    return created.object()


@router.get("/v1/conversations/{conversation_id}")
async def get_conversation(conversation_id: str, request: Request) -> dict[str, Any]:
    return held_conversations(request).get(conversation_id).object()


@router.post("/v1/conversations/{conversation_id}")
async def update_conversation(
    conversation_id: str, body: ConversationBody, request: Request
) -> dict[str, Any]:
    conversation = held_conversations(request).get(conversation_id)
    if body.metadata is not None:
        conversation.metadata = body.metadata
    return conversation.object()


@router.delete("/v1/conversations/{conversation_id}")
async def delete_conversation(conversation_id: str, request: Request) -> dict[str, Any]:
    held_conversations(request).delete(conversation_id)
    return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}


@router.get("/v1/conversations/{conversation_id}/items")
async def list_items(
    conversation_id: str,
    request: Request,
    limit: int = Query(20, ge=1, le=100),
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> dict[str, Any]:
    items = list(held_conversations(request).get(conversation_id).items)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    return item_list(items[:limit], has_more=len(items) > limit)


@router.post("/v1/conversations/{conversation_id}/items")
async def add_items(conversation_id: str, body: ItemsBody, request: Request) -> dict[str, Any]:
    added = held_conversations(request).add(conversation_id, checked_items(body.items))
    return item_list(added)


@router.get("/v1/conversations/{conversation_id}/items/{item_id}")
async def get_item(conversation_id: str, item_id: str, request: Request) -> dict[str, Any]:
    return held_conversations(request).item(conversation_id, item_id)


@router.delete("/v1/conversations/{conversation_id}/items/{item_id}")
async def delete_item(conversation_id: str, item_id: str, request: Request) -> dict[str, Any]:
    return held_conversations(request).remove_item(conversation_id, item_id).object()


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> dict[str, Any]:
    return _stored(request, response_id)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    if not stored_responses(request).delete(response_id):
        _stored(request, response_id)  # the 404
    return {"id": response_id, "object": "response", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items")
async def input_items(
    response_id: str, request: Request, order: Literal["asc", "desc"] = "desc"
) -> dict[str, Any]:
    _stored(request, response_id)
    listed = list(stored_responses(request).input_items(response_id) or [])
    return item_list(listed[::-1] if order == "desc" else listed)


@router.post("/v1/responses/input_tokens")
async def count_input_tokens(body: ResponsesRequest, request: Request, ctx: Context):
    """The prompt tokens a response to `body` would take (OpenAI's input token count)."""
    conversation = named_conversation(body, request)
    items = resolve_references(body.input_items(), stored_responses(request))
    messages = prior_messages(body, request, conversation) + chat_messages(None, items)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    encode = functools.partial(
        ctx.worker.runner.encode,
        tools=body.template_tools(),
        switches=body.template_switches(),
        cache_salt=body.cache_salt,
    )
    try:
        prompt = await fetched_images(system + messages, ctx.fetch_images)
        tokens = await run_in_threadpool(encode, prompt)
    except ValueError as error:
        raise bad_input_error(error, ctx.model_name) from error
    return {"object": "response.input_tokens", "input_tokens": len(tokens)}


def _stored(request: Request, response_id: str) -> dict[str, Any]:
    found = stored_responses(request).response(response_id)
    if found is None:
        raise ApiError(404, f"Response with id '{response_id}' not found.", param="response_id")
    return found
