"""Stored responses, for `previous_response_id`: each response's conversation (input and
output as chat messages, without its instructions), kept in memory, bounded, oldest dropped
first. A server restart forgets them, as `store: false` does for one response."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from fastapi import FastAPI, Request

MAX_RESPONSES = 256
MAX_STORED_CHARS = 64 * 2**20


class ResponseHistory:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_chars: int = MAX_STORED_CHARS):
        self._max_responses = max_responses
        self._max_chars = max_chars
        self._items: OrderedDict[str, tuple[list[dict[str, Any]], int]] = OrderedDict()
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

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        size = len(json.dumps(messages, ensure_ascii=False))
        if size > self._max_chars:
            return
        with self._lock:
            self._items[response_id] = (messages, size)
            self._chars += size
            while len(self._items) > self._max_responses or self._chars > self._max_chars:
                _, (_, dropped) = self._items.popitem(last=False)
                self._chars -= dropped


def keep_responses(app: FastAPI) -> None:
    """Gives `app` its stored responses (empty: a new server remembers none)."""
    app.state.responses = ResponseHistory()


def stored_responses(request: Request) -> ResponseHistory:
    """The stored responses of the app serving `request` (`keep_responses`)."""
    return request.app.state.responses
