"""Stored responses, for `previous_response_id` and the stored-response routes: each
response's conversation (input and output as chat messages, without its instructions), the
response object as it was returned, its input items (as `input_items` lists them), and its
output items, for an input's `item_reference` to them; kept in memory, bounded, oldest dropped
first (its items with it). A server restart forgets them, as `store: false` does for one
response. And what comes before a request's input: its previous response's conversation, or
its conversation's items (`conversations`)."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request

from mlxkv.server.errors import ApiError
from mlxkv.server.responses_api.conversations import held_conversations
from mlxkv.server.responses_api.protocol import InputItem, ResponsesRequest, chat_messages

MAX_RESPONSES = 256
MAX_STORED_CHARS = 64 * 2**20


@dataclass(frozen=True)
class _Stored:
    messages: list[dict[str, Any]]  # the conversation up to and including the response
    response: dict[str, Any]  # as it was returned
    input_items: list[dict[str, Any]]
    chars: int


class ResponseHistory:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_chars: int = MAX_STORED_CHARS):
        self._max_responses = max_responses
        self._max_chars = max_chars
        self._items: OrderedDict[str, _Stored] = OrderedDict()
        self._output: dict[str, dict[str, Any]] = {}  # output item id -> the item
        self._chars = 0
        self._lock = threading.Lock()

    def get(self, response_id: str) -> list[dict[str, Any]] | None:
        """The conversation up to and including that response, or None when not stored."""
        found = self._find(response_id)
        return None if found is None else list(found.messages)

    def response(self, response_id: str) -> dict[str, Any] | None:
        """The response object as it was returned, or None when not stored."""
        found = self._find(response_id)
        return None if found is None else found.response

    def input_items(self, response_id: str) -> list[dict[str, Any]] | None:
        """The response's input items (each with an id), or None when not stored."""
        found = self._find(response_id)
        return None if found is None else found.input_items

    def item(self, item_id: str) -> dict[str, Any] | None:
        """A stored response's output item, or None when not stored."""
        with self._lock:
            return self._output.get(item_id)

    def put(
        self,
        messages: list[dict[str, Any]],
        response: dict[str, Any],
        input_items: list[dict[str, Any]],
    ) -> None:
        chars = len(json.dumps([messages, response, input_items], ensure_ascii=False))
        if chars > self._max_chars:
            return
        with self._lock:
            self._items[response["id"]] = _Stored(messages, response, input_items, chars)
            self._output.update((item["id"], item) for item in response["output"])
            self._chars += chars
            while len(self._items) > self._max_responses or self._chars > self._max_chars:
                self._drop(next(iter(self._items)))

    def delete(self, response_id: str) -> bool:
        """Forgets a stored response; False when none was stored under that id."""
        with self._lock:
            if response_id not in self._items:
                return False
            self._drop(response_id)
            return True

    def _find(self, response_id: str) -> _Stored | None:
        with self._lock:
            found = self._items.get(response_id)
            if found is not None:
                self._items.move_to_end(response_id)
            return found

    def _drop(self, response_id: str) -> None:
        dropped = self._items.pop(response_id)
        self._chars -= dropped.chars
        for item in dropped.response["output"]:
            self._output.pop(item["id"], None)


def resolve_references(items: list[InputItem], history: ResponseHistory) -> list[InputItem]:
    """`items` with each `item_reference` replaced by the stored output item it names: the AI
    SDK's `openai` provider (`store` on, its default) sends an earlier reply's message and
    reasoning so, not their text, and a reference dropped would leave the reply out of the
    conversation.

    Raises:
        ApiError: 400 for a reference without an id, or to an item not stored.
    """
    out = []
    for index, item in enumerate(items):
        if item.type != "item_reference":
            out.append(item)
            continue
        where = f"input[{index}]"
        if not item.id:
            raise ApiError(400, f"{where} is an item_reference without id", param=where)
        found = history.item(item.id)
        if found is None:
            raise ApiError(400, f"Item with id '{item.id}' not found.", param=where)
        out.append(InputItem.model_validate(found))
    return out


def keep_responses(app: FastAPI) -> None:
    """Gives `app` its stored responses (empty: a new server remembers none)."""
    app.state.responses = ResponseHistory()


def stored_responses(request: Request) -> ResponseHistory:
    """The stored responses of the app serving `request` (`keep_responses`)."""
    return request.app.state.responses


def named_conversation(body: ResponsesRequest, request: Request) -> str | None:
    """The id of the conversation `body` names, if it names one held.

    Raises:
        ApiError: 400 with `previous_response_id` too (one history or the other); 404 for a
            conversation not held.
    """
    named = body.conversation
    if named is None:
        return None
    if body.previous_response_id is not None:
        message = "Use either previous_response_id or conversation, not both."
        raise ApiError(400, message, param="conversation")
    conversation_id = named if isinstance(named, str) else str(named.get("id"))
    return held_conversations(request).get(conversation_id).id


def prior_messages(
    body: ResponsesRequest, request: Request, conversation: str | None
) -> list[dict[str, Any]]:
    """The chat messages before `body`'s input: its conversation's items, or the stored
    response `previous_response_id` names (its conversation and output).

    Raises:
        ApiError: 400 for a previous response not stored (OpenAI's code and wording).
    """
    if conversation is not None:
        items = held_conversations(request).get(conversation).input_items()
        return chat_messages(None, items)
    if body.previous_response_id is None:
        return []
    found = stored_responses(request).get(body.previous_response_id)
    if found is None:
        raise ApiError(
            400,
            f"Previous response with id '{body.previous_response_id}' not found.",
            code="previous_response_not_found",
            param="previous_response_id",
        )
    return found
