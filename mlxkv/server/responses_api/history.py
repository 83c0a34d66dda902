"""Stored responses, for `previous_response_id` and the stored-response routes: each
response's conversation (input and output as chat messages, without its instructions), the
response object as it was returned, its input items (as `input_items` lists them), and its
output items, for an input's `item_reference` to them; kept in memory, bounded, oldest dropped
first (its items with it), and in files when the server has a state directory (`saved`: a
restart reads them back; without one a restart forgets them, as `store: false` does for one
response). And what comes before a request's input: its previous response's conversation, or
its conversation's items (`conversations`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request

from mlxkv.server.errors import ApiError
from mlxkv.server.responses_api.conversations import held_conversations
from mlxkv.server.responses_api.protocol import InputItem, ResponsesRequest, chat_messages
from mlxkv.server.responses_api.saved import SavedFiles, items_error
from mlxkv.server.state import BoundedMap, json_chars

MAX_RESPONSES = 256
MAX_STORED_CHARS = 64 * 2**20


@dataclass(frozen=True)
class _Stored:
    salt: str | None  # the `cache_salt` it was made with: another tenant's requests miss it
    # the conversation up to and including the response; None for one that is read only
    # (a background response not ended as a turn: `put_unfinished`)
    messages: list[dict[str, Any]] | None
    message_chars: int
    response: dict[str, Any]  # as it was returned
    input_items: list[dict[str, Any]]


class ResponseHistory:
    """The stored responses; with `saved`, each in a file too, those of its files read now."""

    def __init__(
        self,
        max_responses: int = MAX_RESPONSES,
        max_chars: int = MAX_STORED_CHARS,
        saved: SavedFiles | None = None,
    ):
        self._stored: BoundedMap[_Stored] = BoundedMap(max_responses, max_chars, self._dropped)
        self._output: dict[str, tuple[str | None, dict[str, Any]]] = {}  # item id -> salt, item
        self._saved = saved
        self._replacing: str | None = None  # the id `_keep` is putting
        if saved is not None:
            self._read(saved)

    def get(self, response_id: str, salt: str | None) -> list[dict[str, Any]] | None:
        """The conversation up to and including that response, or None when not stored (or
        not stored for `salt`)."""
        found = self._used(response_id, salt)
        return None if found is None or found.messages is None else list(found.messages)

    def response(self, response_id: str, salt: str | None) -> dict[str, Any] | None:
        """The response object as it was returned, or None when not stored (for `salt`)."""
        found = self._used(response_id, salt)
        return None if found is None else found.response

    def input_items(self, response_id: str, salt: str | None) -> list[dict[str, Any]] | None:
        """The response's input items (each with an id), or None when not stored (for `salt`)."""
        found = self._used(response_id, salt)
        return None if found is None else found.input_items

    def item(self, item_id: str, salt: str | None) -> dict[str, Any] | None:
        """A stored response's output item, or None when not stored (for `salt`)."""
        found = self._output.get(item_id)
        return None if found is None or found[0] != salt else found[1]

    def put(
        self,
        messages: list[dict[str, Any]],
        response: dict[str, Any],
        input_items: list[dict[str, Any]],
        *,
        salt: str | None,
        previous: str | None,
    ) -> None:
        """Stores a response made with `salt`: its conversation `messages` (those of the
        stored response `previous` first, when it continues one: they are not measured again,
        so a long chain is not encoded whole on the event loop on every turn), the response
        and its input items; and writes its file (`saved`: all its messages, so that it reads
        back alone; the bound counts each response's whole chain, so the files fit it too)."""
        if self._keep(messages, response, input_items, salt, previous) and self._saved is not None:
            record = {"id": response["id"], "salt": salt, "previous": previous}
            record |= {"messages": messages, "response": response, "input_items": input_items}
            self._saved.write(record)

    def _keep(
        self,
        messages: list[dict[str, Any]] | None,
        response: dict[str, Any],
        input_items: list[dict[str, Any]],
        salt: str | None,
        previous: str | None,
    ) -> bool:
        """Keeps it in memory (`put`), the messages of `previous` shared; False when it alone
        would pass the bound."""
        before = None if previous is None else self._find(previous, salt)
        if before is not None and before.messages is not None and messages is not None:
            held = len(before.messages)  # one list of its own, the messages before shared
            messages = before.messages + messages[held:]
            message_chars = before.message_chars + json_chars(messages[held:])
        else:
            message_chars = 0 if messages is None else json_chars(messages)
        chars = message_chars + json_chars([response, input_items])
        stored = _Stored(salt, messages, message_chars, response, input_items)
        self._replacing = response["id"]  # its file is written over, not removed first
        try:
            kept = self._stored.put(response["id"], stored, chars)
        finally:
            self._replacing = None
        if not kept:  # nor an older state of it (a background one's from its start) kept
            self._stored.pop(response["id"])
            return False
        if messages is not None:  # a read-only one's items are not referenced
            self._output.update((item["id"], (salt, item)) for item in response["output"])
        return True

    def _read(self, saved: SavedFiles) -> None:
        """Keeps the responses of `saved`'s files, oldest first (as they were put)."""
        for record in saved.read("resp_", _record_error):
            fields = (record["messages"], _ended(record["response"]), record["input_items"])
            if not self._keep(*fields, record["salt"], record["previous"]):
                saved.remove(record["id"])  # too large for the bound now: as if dropped

    def put_unfinished(
        self, response: dict[str, Any], input_items: list[dict[str, Any]] | None, salt: str | None
    ) -> None:
        """Keeps a background response that has not ended as a turn, to be read and not
        continued: one being made (a server killed meanwhile reads it back `failed`), or one
        that ended cancelled or failed (`input_items` None: those kept for it already)."""
        if input_items is None:
            found = self._find(response["id"], salt)
            # deleted or dropped meanwhile; or its turn stored (cut by a stop as it ended)
            if found is None or found.messages is not None:
                return
            input_items = found.input_items
        if self._keep(None, response, input_items, salt, None) and self._saved is not None:
            record = {"id": response["id"], "salt": salt, "previous": None, "messages": None}
            self._saved.write(record | {"response": response, "input_items": input_items})

    def delete(self, response_id: str, salt: str | None) -> bool:
        """Forgets a stored response; False when none was stored under that id (for `salt`)."""
        return self._find(response_id, salt) is not None and bool(self._stored.pop(response_id))

    def _find(self, response_id: str, salt: str | None) -> _Stored | None:
        found = self._stored.get(response_id)
        return None if found is None or found.salt != salt else found

    def _used(self, response_id: str, salt: str | None) -> _Stored | None:
        """`_find` for a client, its file marked as used (`SavedFiles.touch`)."""
        found = self._find(response_id, salt)
        if found is not None and self._saved is not None:
            self._saved.touch(response_id)
        return found

    def _dropped(self, stored: _Stored) -> None:
        for item in stored.response["output"]:
            self._output.pop(item["id"], None)
        # a file replaced is written over in one step: removed first, a kill between the two
        # would leave none
        if self._saved is not None and stored.response["id"] != self._replacing:
            self._saved.remove(stored.response["id"])


def _record_error(record: dict[str, Any]) -> str | None:
    """What keeps a file's record from being a stored response (`put`'s), if anything: each
    part checked before any is kept, so a damaged file changes nothing."""
    fields = ("salt", "previous", "messages", "response", "input_items")
    if any(field not in record for field in fields):
        return f"a stored response has {', '.join(fields)}"
    if not all(isinstance(record[field], str | None) for field in ("salt", "previous")):
        return "its salt or previous response is not a string"
    messages, response = record["messages"], record["response"]
    if messages is not None and not (
        isinstance(messages, list) and all(isinstance(m, dict) for m in messages)
    ):
        return "its messages are not a list of objects"
    if not isinstance(response, dict) or response.get("id") != record["id"]:
        return "its response is not an object with its id"
    if not isinstance(response.get("status"), str):
        return "its response has no status"
    return items_error(response.get("output")) or items_error(record["input_items"])


def _ended(response: dict[str, Any]) -> dict[str, Any]:
    """`response` as a restarted server reads it: one being made when its server was killed
    has failed."""
    if response["status"] not in ("queued", "in_progress"):
        return response
    error = {"code": "server_error", "message": "The server stopped before this response ended."}
    return {**response, "status": "failed", "error": error}


def resolve_references(
    items: list[InputItem], history: ResponseHistory, salt: str | None
) -> list[InputItem]:
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
        found = history.item(item.id, salt)
        if found is None:
            raise ApiError(400, f"Item with id '{item.id}' not found.", param=where)
        out.append(InputItem.model_validate(found))
    return out


def keep_responses(app: FastAPI, saved: SavedFiles | None) -> None:
    """Gives `app` its stored responses: those of `saved`'s files, else none."""
    app.state.responses = ResponseHistory(saved=saved)


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
    conversation_id = named if isinstance(named, str) else named.get("id")
    if not isinstance(conversation_id, str) or not conversation_id:
        raise ApiError(400, "conversation.id must be a conversation's id", param="conversation.id")
    return held_conversations(request).get(conversation_id, body.cache_salt).id


def prior_messages(
    body: ResponsesRequest, request: Request, conversation: str | None
) -> list[dict[str, Any]]:
    """The chat messages before `body`'s input: its conversation's items, or the stored
    response `previous_response_id` names (its conversation and output).

    Raises:
        ApiError: 400 for a previous response not stored (OpenAI's code and wording).
    """
    if conversation is not None:
        items = held_conversations(request).get(conversation, body.cache_salt).input_items()
        return chat_messages(None, items)
    if body.previous_response_id is None:
        return []
    history, previous = stored_responses(request), body.previous_response_id
    found = history.get(previous, body.cache_salt)
    if found is not None:
        return found
    message = f"Previous response with id '{previous}' not found."
    unfinished = history.response(previous, body.cache_salt)
    if unfinished is not None:  # a background response not ended as a turn: no such turn
        status = unfinished["status"]
        said = {"queued": "it has not ended", "in_progress": "it has not ended"}
        said |= {"cancelled": "it was cancelled", "failed": "it failed"}
        state = said.get(status, f"its status is {status}")
        message = (
            f"Previous response with id '{previous}' cannot be continued: {state}. Continue "
            "the response before it, or send the whole input."
        )
    # one code for both: a client that recovers from it sends the whole input again
    raise ApiError(400, message, code="previous_response_not_found", param="previous_response_id")


def request_prompt(
    body: ResponsesRequest, request: Request
) -> tuple[str | None, list[InputItem], list[dict[str, Any]]]:
    """What a request is answered from: the conversation it names (if any), its input items
    (references resolved) and the chat messages of what comes before them and of them (its
    `instructions` apart)."""
    conversation = named_conversation(body, request)
    items = resolve_references(body.input_items(), stored_responses(request), body.cache_salt)
    messages = prior_messages(body, request, conversation) + chat_messages(None, items)
    return conversation, items, messages
