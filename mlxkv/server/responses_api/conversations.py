"""OpenAI's Conversations: items kept by the server under a `conv_...` id (`/v1/conversations`,
its items listed, added and deleted), and a response that names one (`conversation`): its
items come before the request's input, and the input and the response's output are added
after them when the response ends (the OpenAI Agents SDK's `OpenAIConversationsSession` and
`conversation_id` runs keep their history so). Kept in memory, bounded (the least recently
used dropped first, by count and by the size of their items); a restart forgets them, and a
conversation not held is a 404 in OpenAI's shape, as an unknown one is there."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from pydantic import ValidationError

from mlxkv.server.errors import ApiError
from mlxkv.server.responses_api.items import listed_item
from mlxkv.server.responses_api.protocol import InputItem

MAX_CONVERSATIONS = 256
MAX_STORED_CHARS = 64 * 2**20
# The most items one create or add takes, as OpenAI's.
MAX_ITEMS_PER_CALL = 20


@dataclass
class Conversation:
    id: str
    created_at: int
    metadata: dict[str, Any]
    items: list[dict[str, Any]] = field(default_factory=list)  # as listed, oldest first
    chars: int = 0

    def object(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "conversation",
            "created_at": self.created_at,
            "metadata": self.metadata,
        }

    def input_items(self) -> list[InputItem]:
        """Its items as a response's input."""
        return [InputItem.model_validate(item) for item in self.items]


class Conversations:
    def __init__(
        self, max_conversations: int = MAX_CONVERSATIONS, max_chars: int = MAX_STORED_CHARS
    ):
        self._max_conversations = max_conversations
        self._max_chars = max_chars
        self._held: OrderedDict[str, Conversation] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def create(self, items: Any, metadata: dict[str, Any]) -> Conversation:
        """A new conversation of `items` (a request's, checked: `checked_items`)."""
        listed = checked_items(items)
        conversation = Conversation(f"conv_{uuid.uuid4().hex}", int(time.time()), metadata)
        with self._lock:
            self._held[conversation.id] = conversation
        self.add(conversation.id, listed)
        return conversation

    def get(self, conversation_id: str) -> Conversation:
        """Raises:
        ApiError: 404 for a conversation not held."""
        with self._lock:
            found = self._held.get(conversation_id)
            if found is not None:
                self._held.move_to_end(conversation_id)
        if found is None:
            raise ApiError(404, f"Conversation with id '{conversation_id}' not found.")
        return found

    def add(self, conversation_id: str, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Appends `items` (listed: `listed_item`) to the conversation; returns them.

        Raises:
            ApiError: 404 for a conversation not held.
        """
        conversation = self.get(conversation_id)
        chars = len(json.dumps(items, ensure_ascii=False))
        with self._lock:
            conversation.items.extend(items)
            conversation.chars += chars
            self._chars += chars
            while len(self._held) > self._max_conversations or (
                self._chars > self._max_chars and len(self._held) > 1
            ):
                _, dropped = self._held.popitem(last=False)
                self._chars -= dropped.chars
        return items

    def remove_item(self, conversation_id: str, item_id: str) -> Conversation:
        """Raises:
        ApiError: 404 for a conversation not held or an item not in it."""
        conversation = self.get(conversation_id)
        with self._lock:
            index = _index(conversation, item_id)
            removed = conversation.items.pop(index)
            chars = len(json.dumps(removed, ensure_ascii=False))
            conversation.chars -= chars
            self._chars -= chars
        return conversation

    def item(self, conversation_id: str, item_id: str) -> dict[str, Any]:
        conversation = self.get(conversation_id)
        with self._lock:
            return conversation.items[_index(conversation, item_id)]

    def delete(self, conversation_id: str) -> None:
        self.get(conversation_id)
        with self._lock:
            dropped = self._held.pop(conversation_id, None)
            if dropped is not None:
                self._chars -= dropped.chars


def checked_items(raw: Any, param: str = "items") -> list[dict[str, Any]]:
    """`raw` (a request's `items`) as listed items.

    Raises:
        ApiError: 400 for more than `MAX_ITEMS_PER_CALL` items, or one that is not an item.
    """
    if not isinstance(raw, list):
        raise ApiError(400, f"{param} must be an array of items", param=param)
    if len(raw) > MAX_ITEMS_PER_CALL:
        message = f"{param} holds {len(raw)} items; at most {MAX_ITEMS_PER_CALL} are added at once"
        raise ApiError(400, message, param=param)
    for index, item in enumerate(raw):
        try:
            InputItem.model_validate(item)
        except ValidationError as error:
            where = f"{param}[{index}]"
            message = f"{where} is not an item: {error.errors()[0]['msg']}"
            raise ApiError(400, message, param=where) from None
    return [listed_item(item) for item in raw]


def _index(conversation: Conversation, item_id: str) -> int:
    for index, item in enumerate(conversation.items):
        if item.get("id") == item_id:
            return index
    raise ApiError(404, f"Item with id '{item_id}' not found in conversation '{conversation.id}'.")


def keep_conversations(app: FastAPI) -> None:
    """Gives `app` its conversations (none: a new server holds none)."""
    app.state.conversations = Conversations()


def held_conversations(request: Request) -> Conversations:
    """The conversations of the app serving `request` (`keep_conversations`)."""
    return request.app.state.conversations
