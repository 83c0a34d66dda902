"""Items as OpenAI lists them (a response's input items, a conversation's items): each with
an id, a message's content as parts; and a page of them."""

from __future__ import annotations

import uuid
from typing import Any

# The prefix of a listed item's id, by its type (as OpenAI names them), else "item".
_ID_PREFIXES = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
}


def listed_item(raw: dict[str, Any]) -> dict[str, Any]:
    """An input item (as sent, or an `InputItem` dumped) as OpenAI lists one (a response's
    `input_items`, a conversation's items): with an id (its own, else a new one), a message's
    content as parts."""
    kind = raw.get("type", "message")
    listed = {**raw, "type": kind}
    listed.setdefault("id", f"{_ID_PREFIXES.get(kind, 'item')}_{uuid.uuid4().hex}")
    if kind == "message":
        part = "output_text" if raw.get("role") == "assistant" else "input_text"
        if isinstance(raw.get("content"), str):
            listed["content"] = [{"type": part, "text": raw["content"]}]
    if kind in _ID_PREFIXES:
        listed.setdefault("status", "completed")
    return listed


def item_list(items: list[dict[str, Any]], has_more: bool = False) -> dict[str, Any]:
    """OpenAI's list of items, one page."""
    first, last = (items[0]["id"], items[-1]["id"]) if items else (None, None)
    return {
        "object": "list",
        "data": items,
        "first_id": first,
        "last_id": last,
        "has_more": has_more,
    }
