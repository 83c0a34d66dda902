"""The routes of what the Responses API keeps on the server. Conversations
(`/v1/conversations`: created with items and metadata, read, their metadata updated, deleted;
their items listed a page at a time, `order` and `after` as OpenAI's, added, read and deleted;
the store is `conversations`); a stored response read, its input items listed, deleted
(`history`), or a background one read as it is made, its events again, cancelled
(`background`); and the input tokens a response would take, counted before it is sent. What a
request made with a `cache_salt` keeps is reached only with it (in the body, or as a query
parameter where there is no body): another tenant gets a 404."""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from mlxkv.server.errors import ApiError, bad_input_error
from mlxkv.server.images import fetched_images
from mlxkv.server.protocol import Lenient
from mlxkv.server.responses_api.background import background_responses
from mlxkv.server.responses_api.conversations import checked_items, held_conversations
from mlxkv.server.responses_api.history import request_prompt, stored_responses
from mlxkv.server.responses_api.items import item_list
from mlxkv.server.responses_api.protocol import ResponsesRequest
from mlxkv.server.responses_api.saved import saved_to_disk
from mlxkv.server.state import Context, replay_stream

router = APIRouter()
# A GET's or a DELETE's `cache_salt` (they have no body): what was made with one is its own.
Salt = Annotated[str | None, Query(min_length=1, max_length=256)]


class Paging:
    """A listing's query: `limit` items, in `order`, after the item `after` names."""

    def __init__(
        self,
        limit: int = Query(20, ge=1, le=100),
        order: Literal["asc", "desc"] = "desc",
        after: str | None = None,
    ):
        self.limit, self.order, self.after = limit, order, after


Page = Annotated[Paging, Depends()]


class ConversationBody(Lenient):
    items: list[Any] | None = None
    metadata: dict[str, str] | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256)


class ItemsBody(Lenient):
    items: list[Any] = Field(min_length=1)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)


@router.post("/v1/conversations")
async def create_conversation(body: ConversationBody, request: Request) -> dict[str, Any]:
    held = held_conversations(request)
    created = held.create(body.items or [], body.metadata or {}, body.cache_salt)
    await saved_to_disk(request)
    return created.object()


@router.get("/v1/conversations/{conversation_id}")
async def get_conversation(
    conversation_id: str, request: Request, cache_salt: Salt = None
) -> dict[str, Any]:
    return held_conversations(request).get(conversation_id, cache_salt).object()


@router.post("/v1/conversations/{conversation_id}")
async def update_conversation(
    conversation_id: str, body: ConversationBody, request: Request
) -> dict[str, Any]:
    held, salt = held_conversations(request), body.cache_salt
    if body.metadata is None:
        return held.get(conversation_id, salt).object()
    updated = held.set_metadata(conversation_id, body.metadata, salt)
    await saved_to_disk(request)
    return updated.object()


@router.delete("/v1/conversations/{conversation_id}")
async def delete_conversation(
    conversation_id: str, request: Request, cache_salt: Salt = None
) -> dict[str, Any]:
    held_conversations(request).delete(conversation_id, cache_salt)
    await saved_to_disk(request)
    return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}


@router.get("/v1/conversations/{conversation_id}/items")
async def list_items(
    conversation_id: str, request: Request, paging: Page, cache_salt: Salt = None
) -> dict[str, Any]:
    return _page(held_conversations(request).get(conversation_id, cache_salt).items, paging)


@router.post("/v1/conversations/{conversation_id}/items")
async def add_items(conversation_id: str, body: ItemsBody, request: Request) -> dict[str, Any]:
    held = held_conversations(request)
    added = held.add(conversation_id, checked_items(body.items), body.cache_salt)
    await saved_to_disk(request)
    return item_list(added)


@router.get("/v1/conversations/{conversation_id}/items/{item_id}")
async def get_item(
    conversation_id: str, item_id: str, request: Request, cache_salt: Salt = None
) -> dict[str, Any]:
    return held_conversations(request).item(conversation_id, item_id, cache_salt)


@router.delete("/v1/conversations/{conversation_id}/items/{item_id}")
async def delete_item(
    conversation_id: str, item_id: str, request: Request, cache_salt: Salt = None
) -> dict[str, Any]:
    kept = held_conversations(request).remove_item(conversation_id, item_id, cache_salt)
    await saved_to_disk(request)
    return kept.object()


@router.get("/v1/responses/{response_id}")
async def get_response(
    response_id: str,
    request: Request,
    cache_salt: Salt = None,
    stream: bool = False,
    starting_after: int | None = Query(None, ge=0),
):
    """The response as it stands (a background one while it is made); `stream`: a background
    response's events, those after `starting_after` (a `sequence_number`) first."""
    run = background_responses(request).find(response_id, cache_salt)
    if run is None:
        found = _stored(request, response_id, cache_salt)
        if not stream:
            return found
        if found.get("background"):  # among the oldest
            raise ApiError(400, "This response's events are no longer kept.", param="stream")
        message = "Only background responses can be streamed again: this one was not."
        raise ApiError(400, message, param="stream")
    if not stream:
        return run.latest
    run.check_after(starting_after)
    return replay_stream(run.read(-1 if starting_after is None else starting_after))


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(
    response_id: str, request: Request, cache_salt: Salt = None
) -> dict[str, Any]:
    """Cancels a background response being made; one cancelled already is returned as it is
    (OpenAI's: cancelling twice is idempotent).

    Raises:
        ApiError: 400 for a response that was not made in the background, or has ended
            otherwise; 404 for one not held.
    """
    run = background_responses(request).find(response_id, cache_salt)
    found = run.latest if run is not None else _stored(request, response_id, cache_salt)
    if not found.get("background"):
        message = "Only responses created with background set to true can be cancelled."
        raise ApiError(400, message, param="response_id")
    if found["status"] not in ("queued", "in_progress", "cancelled"):
        message = f"Cannot cancel a response that has ended: its status is {found['status']}."
        raise ApiError(400, message, param="response_id")
    if run is not None:
        await run.cancel()
        await saved_to_disk(request)
    return run.latest if run is not None else found


@router.delete("/v1/responses/{response_id}")
async def delete_response(
    response_id: str, request: Request, cache_salt: Salt = None
) -> dict[str, Any]:
    """Forgets a stored response; a background one being made is cancelled first."""
    background = background_responses(request)
    run = background.find(response_id, cache_salt)
    if run is not None:
        await run.cancel()
        background.forget(response_id)
    deleted = stored_responses(request).delete(response_id, cache_salt)
    if run is None and not deleted:
        raise _not_stored(response_id)
    await saved_to_disk(request)
    return {"id": response_id, "object": "response", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items")
async def input_items(
    response_id: str, request: Request, paging: Page, cache_salt: Salt = None
) -> dict[str, Any]:
    listed = stored_responses(request).input_items(response_id, cache_salt)
    if listed is None:
        raise _not_stored(response_id)
    return _page(listed, paging)


@router.post("/v1/responses/input_tokens")
async def count_input_tokens(body: ResponsesRequest, request: Request, ctx: Context):
    """The prompt tokens a response to `body` would take (OpenAI's input token count)."""
    _, _, messages = request_prompt(body, request)
    encode = functools.partial(
        ctx.worker.runner.encode,
        tools=body.template_tools(),
        switches=body.template_switches(),
        cache_salt=body.cache_salt,
    )
    try:
        prompt = await fetched_images(body.system_messages() + messages, ctx.fetch_images)
        tokens = await run_in_threadpool(encode, prompt)
    except ValueError as error:
        raise bad_input_error(error, ctx.model_name) from error
    return {"object": "response.input_tokens", "input_tokens": len(tokens)}


def _page(items: list[dict[str, Any]], paging: Paging) -> dict[str, Any]:
    """One page of `items` (oldest first), as OpenAI lists them.

    Raises:
        ApiError: 400 for an `after` that names none of them.
    """
    ordered = items[::-1] if paging.order == "desc" else list(items)
    if paging.after is not None:
        ids = [item["id"] for item in ordered]
        if paging.after not in ids:
            message = f"after: no item has the id '{paging.after}'"
            raise ApiError(400, message, param="after")
        ordered = ordered[ids.index(paging.after) + 1 :]
    return item_list(ordered[: paging.limit], has_more=len(ordered) > paging.limit)


def _stored(request: Request, response_id: str, salt: str | None) -> dict[str, Any]:
    """Raises:
    ApiError: 404 for a response not stored (for `salt`)."""
    found = stored_responses(request).response(response_id, salt)
    if found is None:
        raise _not_stored(response_id)
    return found


def _not_stored(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", param="response_id")
