"""Anthropic's message threads (the `message-threads-2026-08-12` beta, which the SDKs'
`beta.messages.thread()` and tool runners turn on by default): `thread: {"type": "create"}`
keeps the request's conversation and its reply under the reply's message id, and
`{"type": "continue", "previous_message_id": ...}` sends only the new turn's messages, the
server supplying the rest, `system` and `tools` included. Dropped, the field made a continued
turn a conversation of its last message alone (its system prompt and tools gone, and a
`tool_choice` refused for want of tools).

A thread's state is the conversation up to one reply; it never changes, so a reply may be
continued more than once (the real API refuses that with `thread_already_continued`, which
the SDKs answer by sending the whole history again: the same conversation). Kept in memory,
bounded, the least recently used dropped first; a server restart forgets them, and a
`continue` from one not kept is a 404 `thread_not_found`, on which the SDKs send the whole
history under a new thread. A thread is its creator's `cache_salt`'s: another tenant cannot
continue it, even knowing its id."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request

from mlxkv.server.anthropic_api.protocol import Message, PromptFields
from mlxkv.server.errors import ApiError
from mlxkv.server.state import BoundedMap

# A request's body: `/v1/messages`' or `/v1/messages/count_tokens`'.
Body = TypeVar("Body", bound=PromptFields)
MAX_THREADS = 256
MAX_STORED_CHARS = 64 * 2**20
# The fields a thread keeps from its `create`; a `continue` that sends one must send it equal.
_CREATE_ONLY = ("system", "tools")


@dataclass(frozen=True)
class _Thread:
    salt: str | None
    system: Any
    tools: Any
    messages: list[Message]  # the conversation, its reply last


class MessageThreads:
    def __init__(self, max_threads: int = MAX_THREADS, max_chars: int = MAX_STORED_CHARS):
        self._threads: BoundedMap[_Thread] = BoundedMap(max_threads, max_chars)

    def resume(self, body: Body) -> Body:
        """`body` as the whole conversation: for a `continue`, the kept thread's messages, then
        `body`'s, with the thread's `system` and `tools`; any other body as it is.

        Raises:
            ApiError: 400 for a `continue` without `previous_message_id` or changing a field
                kept from the `create` (`thread_fingerprint_mismatch`); 404 for a thread not
                kept (`thread_not_found`).
        """
        thread = body.thread
        if thread is None or thread.type != "continue":
            return body
        previous = thread.previous_message_id
        if not previous:
            message = "thread.previous_message_id: a continue names the reply it continues"
            raise ApiError(400, message, param="thread.previous_message_id")
        kept = self._threads.get(previous)
        if kept is None or kept.salt != body.cache_salt:
            message = f"no thread holds the message {previous!r}; send the whole conversation"
            raise ApiError(404, message, details={"error_code": "thread_not_found"})
        changed = [f"`{name}`" for name in _CREATE_ONLY if _changes(body, kept, name)]
        if changed:
            message = f"{' and '.join(changed)} differ from the thread's; start a new thread"
            raise ApiError(400, message, details={"error_code": "thread_fingerprint_mismatch"})
        history = [*kept.messages, *body.messages]
        return body.model_copy(update={"messages": history, **_fields(kept)})

    def keep(self, message_id: str, body: PromptFields, reply: list[dict[str, Any]]) -> None:
        """Keeps `body`'s conversation (`resume`d) and its `reply` (content blocks) under
        `message_id` when `body` asks for a thread; an empty reply (a pre-warm) is not kept.
        Its size is the thread's it continues plus what this turn added (measured alone: a
        long thread is not written out whole on every turn); a new thread's, its `system`
        and `tools` too."""
        if body.thread is None or not reply:
            return
        messages = [*body.messages, Message(role="assistant", content=reply)]
        continued = body.thread.previous_message_id if body.thread.type == "continue" else None
        previous = None if continued is None else self._threads.get(continued)
        if previous is None:  # a new thread (or its previous turn dropped meanwhile)
            held, chars = 0, len(json.dumps([_dumped(body.system), _dumped(body.tools)]))
        else:
            held, chars = len(previous.messages), self._threads.chars_of(continued or "")
        chars += sum(len(message.model_dump_json()) for message in messages[held:])
        kept = _Thread(body.cache_salt, body.system, body.tools, messages)
        self._threads.put(message_id, kept, chars)


def _dumped(value: Any) -> Any:
    """`system` or `tools` as JSON data (text, blocks or tool models)."""
    if isinstance(value, list):
        return [item.model_dump() if hasattr(item, "model_dump") else item for item in value]
    return value


def _changes(body: PromptFields, kept: _Thread, name: str) -> bool:
    return name in body.model_fields_set and getattr(body, name) != getattr(kept, name)


def _fields(kept: _Thread) -> dict[str, Any]:
    return {name: getattr(kept, name) for name in _CREATE_ONLY}


def keep_threads(app: FastAPI) -> None:
    """Gives `app` its message threads (empty: a new server holds none)."""
    app.state.message_threads = MessageThreads()


def message_threads(request: Request) -> MessageThreads:
    """The message threads of the app serving `request` (`keep_threads`)."""
    return request.app.state.message_threads
