"""Chat messages and tools as a chat template takes them.

Owns the prompt forms (`Prompt`), what a prompt of chat messages is (`is_messages`; of token
ids: `is_token_ids`), the system messages it starts with, and system messages after the first
turn folded into user turns for templates that refuse them (`fold_system_reminders`). Their
checks, and rendering them, are `chat`'s; the checks of the other forms, `prompt`'s.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

Message = dict[str, Any]
Tools = Sequence[dict[str, Any]]
# The three prompt forms: text (taken as rendered), token ids, chat messages.
Prompt = str | Sequence[int] | Sequence[Message]


def checked_tools(tools: Tools) -> list[dict[str, Any]]:
    """`tools` as a list, each a dict (what a chat template reads).

    Raises:
        ValueError: not a list of dicts.
    """
    if isinstance(tools, str | bytes) or not isinstance(tools, Sequence):
        raise ValueError(f"tools must be a list of dicts, got {type(tools).__name__}")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ValueError(f"tool {i} must be a dict, got {type(tool).__name__}")
    return list(tools)


def fold_system_reminders(messages: Sequence[Message]) -> list[Message]:
    """`messages` with each system message after the first turn moved into the next user
    message (the previous one when none follows) as a `<system-reminder>` block, the form
    Claude Code itself uses, for templates that refuse a system message anywhere but first.
    A user message of parts (an image beside its text) gets the block as a text part; a
    system message with other than text stays where it is."""
    lead = len(leading_system_messages(messages))
    out = list(messages[:lead])
    held: list[str] = []
    for message in messages[lead:]:
        if message["role"] == "system" and (text := _plain_text(message["content"])) is not None:
            held.append(f"<system-reminder>\n{text}\n</system-reminder>")
            continue
        if held and message["role"] == "user":
            message = {**message, "content": _with_text(held, message["content"], first=True)}
            held = []
        out.append(message)
    if held:
        last_user = max((i for i, m in enumerate(out) if m["role"] == "user"), default=None)
        if last_user is None:
            out.append({"role": "user", "content": "\n\n".join(held)})
        else:
            content = _with_text(held, out[last_user]["content"], first=False)
            out[last_user] = {**out[last_user], "content": content}
    return out


def _plain_text(content: Any) -> str | None:
    """A message's content as one text: a string, or text parts joined; None otherwise."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list | tuple):
        return None
    texts = [
        p.get("text") if isinstance(p, dict) and p.get("type") == "text" else None for p in content
    ]
    return "".join(texts) if all(isinstance(t, str) for t in texts) else None


def _with_text(held: list[str], content: Any, *, first: bool) -> Any:
    """`content` (a string or parts) with the `held` blocks before it or after it."""
    if isinstance(content, str):
        return "\n\n".join([*held, content] if first else [content, *held])
    if first:
        return [{"type": "text", "text": "\n\n".join(held) + "\n\n"}, *content]
    return [*content, {"type": "text", "text": "\n\n" + "\n\n".join(held)}]


def is_messages(prompt: Any) -> bool:
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, str)
        and bool(prompt)
        and isinstance(prompt[0], dict)
    )


def is_token_ids(prompt: Sequence[Any]) -> bool:
    """Whether every item is an integer (numpy's too), never a bool. Plain ints are checked by
    type first: the `numbers.Integral` check costs about 1.4 us an item, 46 ms of a
    32k-token prompt's time to first token on this repository's CPU."""
    return all(type(t) is int for t in prompt) or all(
        isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt
    )


def leading_system_messages(prompt: Any) -> list[Message]:
    """The system messages a chat starts with (none for text or token prompts)."""
    if not is_messages(prompt):
        return []
    system = []
    for message in prompt:
        if message.get("role") != "system":
            break
        system.append(message)
    return system
