"""Stored responses, for `previous_response_id`: each response's conversation (input and
output as chat messages, without its instructions), and its output items, for an input's
`item_reference` to them; kept in memory, bounded, oldest dropped first (its items with it).
A server restart forgets them, as `store: false` does for one response."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from fastapi import FastAPI, Request

from mlxkv.server.errors import ApiError
from mlxkv.server.responses_api.protocol import InputItem

MAX_RESPONSES = 256
MAX_STORED_CHARS = 64 * 2**20


class ResponseHistory:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_chars: int = MAX_STORED_CHARS):
        self._max_responses = max_responses
        self._max_chars = max_chars
        # response id -> (conversation, its size in characters, its output items' ids)
        self._items: OrderedDict[str, tuple[list[dict[str, Any]], int, list[str]]] = OrderedDict()
        self._output: dict[str, dict[str, Any]] = {}  # output item id -> the item
        self._chars = 0
        self._lock = threading.Lock()

    def get(self, response_id: str) -> list[dict[str, Any]] | None:
        """The conversation up to and including that response, or None when not stored."""
        with self._lock:
            found = self._items.get(response_id)
            if found is None:
                return None
            self._items.move_to_end(response_id)
            return list(found[0])

    def item(self, item_id: str) -> dict[str, Any] | None:
        """A stored response's output item, or None when not stored."""
        with self._lock:
            return self._output.get(item_id)

    def put(
        self, response_id: str, messages: list[dict[str, Any]], output: list[dict[str, Any]]
    ) -> None:
        size = len(json.dumps([messages, output], ensure_ascii=False))
        if size > self._max_chars:
            return
        with self._lock:
            self._items[response_id] = (messages, size, [item["id"] for item in output])
            self._output.update((item["id"], item) for item in output)
            self._chars += size
            while len(self._items) > self._max_responses or self._chars > self._max_chars:
                _, (_, dropped, item_ids) = self._items.popitem(last=False)
                self._chars -= dropped
                for item_id in item_ids:
                    del self._output[item_id]


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
