"""OpenAI's Conversations: items kept by the server under a `conv_...` id (`/v1/conversations`,
its items listed, added and deleted), and a response that names one (`conversation`): its
items come before the request's input, and the input and the response's output are added
after them when the response ends (the OpenAI Agents SDK's `OpenAIConversationsSession` and
`conversation_id` runs keep their history so). Kept in memory, bounded (the least recently
used dropped first, by count and by the size of their items), and in files when the server has
a state directory (`saved`: a restart reads them back; without one it forgets them); a
conversation not held is a 404 in OpenAI's shape, as an unknown one is there. One response at
a time is made in a conversation (`ConversationClaim`): a second one meanwhile is refused
with OpenAI's 400 `conversation_locked`."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from pydantic import ValidationError

from mlxkv.server.errors import ApiError
from mlxkv.server.responses_api.items import listed_item
from mlxkv.server.responses_api.protocol import InputItem, chat_messages
from mlxkv.server.responses_api.saved import SavedFiles, items_error
from mlxkv.server.state import BoundedMap, json_chars

MAX_CONVERSATIONS = 256
MAX_STORED_CHARS = 64 * 2**20
# The most items one create or add takes, as OpenAI's.
MAX_ITEMS_PER_CALL = 20
# OpenAI's words for a response in a conversation another response is being made in.
_LOCKED = (
    "Another process is currently operating on this conversation. Please retry in a few seconds."
)


@dataclass
class Conversation:
    id: str
    created_at: int
    metadata: dict[str, Any]
    salt: str | None  # the `cache_salt` it was made with: another tenant's requests miss it
    items: list[dict[str, Any]] = field(default_factory=list)  # as listed, oldest first

    def record(self) -> dict[str, Any]:
        """What its file holds (`saved`): a copy, its items as they are now."""
        return {**self.object(), "salt": self.salt, "items": list(self.items)}

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
    """The conversations held, each measured by its items and metadata (`BoundedMap`): an
    add that would take one past the whole bound is refused (a 400), never kept in part.
    With `saved`, each is in a file too, written again at each change; those of its files are
    read now."""

    def __init__(
        self,
        max_conversations: int = MAX_CONVERSATIONS,
        max_chars: int = MAX_STORED_CHARS,
        saved: SavedFiles | None = None,
    ):
        self._held: BoundedMap[Conversation] = BoundedMap(
            max_conversations, max_chars, self._dropped
        )
        self._busy: set[str] = set()  # those a response is being made in (`claim`)
        self._saved = saved
        if saved is not None:
            self._read(saved)

    def create(self, items: Any, metadata: dict[str, Any], salt: str | None) -> Conversation:
        """A new conversation of `items` (a request's, checked: `checked_items`).

        Raises:
            ApiError: 400 for items that are not, or too many, or too large to keep.
        """
        listed = checked_items(items)
        conversation = Conversation(f"conv_{uuid.uuid4().hex}", int(time.time()), metadata, salt)
        if not self._held.put(conversation.id, conversation, json_chars(metadata)):
            raise _too_large("metadata", self._held.max_chars)
        try:
            self.add(conversation.id, listed, salt)
        except ApiError:  # refused whole: not kept empty
            self._held.pop(conversation.id)
            raise
        return conversation

    def get(self, conversation_id: str, salt: str | None) -> Conversation:
        """Raises:
        ApiError: 404 for a conversation not held (or not for `salt`)."""
        found = self._held.get(conversation_id)
        if found is None or found.salt != salt:
            message = f"Conversation with id '{conversation_id}' not found."
            raise ApiError(404, message, param="conversation_id")
        if self._saved is not None:  # in its file too (`SavedFiles.touch`)
            self._saved.touch(conversation_id)
        return found

    def add(
        self,
        conversation_id: str,
        items: list[dict[str, Any]],
        salt: str | None,
        *,
        skip_held: bool = False,
    ) -> list[dict[str, Any]]:
        """Appends `items` (listed: `listed_item`) to the conversation; returns them. An item
        whose id it holds already is refused, or left out with `skip_held` (a response's
        input sending an item of its conversation again).

        Raises:
            ApiError: 404 for a conversation not held; 400 for an id held or given twice, or
                when they would take it past the bound (nothing added).
        """
        conversation = self.get(conversation_id, salt)
        held = {item["id"] for item in conversation.items}
        if skip_held:
            items = [item for item in items if item["id"] not in held]
        ids = [item["id"] for item in items]
        if len(set(ids)) < len(ids) or held.intersection(ids):
            message = "items: an item's id is already in the conversation (or given twice)"
            raise ApiError(400, message, param="items")
        if not self._held.grow(conversation_id, sum(json_chars(item) for item in items)):
            raise _too_large("items", self._held.max_chars)
        conversation.items.extend(items)
        self._write(conversation)
        return items

    def claim(self, conversation_id: str) -> Callable[[], None]:
        """Marks the conversation as having a response made in it, until the returned call:
        a second response would read it without the first's turn, and the two turns would
        be added in the order the replies end.

        Raises:
            ApiError: 400 `conversation_locked` (OpenAI's) while another response holds it.
        """
        if conversation_id in self._busy:
            raise ApiError(400, _LOCKED, code="conversation_locked", param="conversation")
        self._busy.add(conversation_id)
        return lambda: self._busy.discard(conversation_id)

    def set_metadata(self, conversation_id: str, metadata: dict[str, Any], salt: str | None):
        conversation = self.get(conversation_id, salt)
        grown = json_chars(metadata) - json_chars(conversation.metadata)
        if not self._held.grow(conversation_id, grown):
            raise _too_large("metadata", self._held.max_chars)
        conversation.metadata = metadata
        self._write(conversation)
        return conversation

    def remove_item(self, conversation_id: str, item_id: str, salt: str | None) -> Conversation:
        """Raises:
        ApiError: 404 for a conversation not held or an item not in it."""
        conversation = self.get(conversation_id, salt)
        removed = conversation.items.pop(_index(conversation, item_id))
        self._held.grow(conversation_id, -json_chars(removed))
        self._write(conversation)
        return conversation

    def item(self, conversation_id: str, item_id: str, salt: str | None) -> dict[str, Any]:
        conversation = self.get(conversation_id, salt)
        return conversation.items[_index(conversation, item_id)]

    def delete(self, conversation_id: str, salt: str | None) -> None:
        self.get(conversation_id, salt)
        self._held.pop(conversation_id)

    def _write(self, conversation: Conversation) -> None:
        if self._saved is not None:
            self._saved.write(conversation.record())

    def _dropped(self, conversation: Conversation) -> None:
        if self._saved is not None:
            self._saved.remove(conversation.id)

    def _read(self, saved: SavedFiles) -> None:
        """Holds the conversations of `saved`'s files, the least recently used first."""
        for record in saved.read("conv_", _record_error):
            items, metadata = record["items"], record["metadata"]
            conversation = Conversation(
                record["id"], record["created_at"], metadata, record["salt"], items
            )
            chars = json_chars(metadata) + sum(json_chars(item) for item in items)
            if not self._held.put(conversation.id, conversation, chars):
                saved.remove(conversation.id)  # too large for the bound now: as if dropped


def _record_error(record: dict[str, Any]) -> str | None:
    """What keeps a file's record from being a conversation (`Conversation.record`), if
    anything: checked whole before it is held, so a damaged file changes nothing."""
    if not isinstance(record.get("created_at"), int):
        return "its created_at is not a number of seconds"
    if not isinstance(record.get("metadata"), dict):
        return "its metadata is not an object"
    if "salt" not in record or not isinstance(record["salt"], str | None):
        return "its salt is not a string"
    return items_error(record.get("items"))


def _too_large(what: str, max_chars: int) -> ApiError:
    message = f"the conversation with these {what} would take over {max_chars:,} characters"
    return ApiError(400, message, param=what)


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
    checked = []
    for index, item in enumerate(raw):
        where = f"{param}[{index}]"
        try:
            checked.append(InputItem.model_validate(item))
        except ValidationError as error:
            message = f"{where} is not an item: {error.errors()[0]['msg']}"
            raise ApiError(400, message, param=where) from None
        if checked[-1].type == "item_reference":  # names a response's item by its id alone
            raise ApiError(400, f"{where}: add the item itself, not a reference", param=where)
    chat_messages(None, checked, param)  # as a response will read them: 400 where it cannot
    return [listed_item(item) for item in raw]


def _index(conversation: Conversation, item_id: str) -> int:
    for index, item in enumerate(conversation.items):
        if item.get("id") == item_id:
            return index
    raise ApiError(404, f"Item with id '{item_id}' not found in conversation '{conversation.id}'.")


class TurnClaim:
    """The conversation one response request is made in (`Conversations.claim`), released
    once its turn is added (`release`, before the response's last bytes go out: the client's
    next turn may come at once) or else when the request ends, however it ends (a failure,
    a client that left, a stream that never started): `ConversationClaim`."""

    def __init__(self) -> None:
        self._release: Callable[[], None] | None = None

    def take(self, conversations: Conversations, conversation_id: str) -> None:
        """Claims the conversation for this request.

        Raises:
            ApiError: 400 `conversation_locked` while another response holds it.
        """
        self._release = conversations.claim(conversation_id)

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    def detach(self) -> TurnClaim:
        """The claim, handed to what outlives the request (a background response): the
        request's end no longer releases it."""
        detached = TurnClaim()
        detached._release, self._release = self._release, None
        return detached


async def turn_claim() -> AsyncIterator[TurnClaim]:
    """A claim for one request, released when its response has ended (FastAPI ends a
    dependency that yields once the response is sent, a streamed one included)."""
    claim = TurnClaim()
    try:
        yield claim
    finally:
        claim.release()


# A route parameter of this type receives its request's `TurnClaim`.
ConversationClaim = Annotated[TurnClaim, Depends(turn_claim)]


def keep_conversations(app: FastAPI, saved: SavedFiles | None) -> None:
    """Gives `app` its conversations: those of `saved`'s files, else none."""
    app.state.conversations = Conversations(saved=saved)


def held_conversations(request: Request) -> Conversations:
    """The conversations of the app serving `request` (`keep_conversations`)."""
    return request.app.state.conversations
