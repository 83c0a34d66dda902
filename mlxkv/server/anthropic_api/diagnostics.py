"""Anthropic's cache diagnostics: a request with `diagnostics.previous_message_id` gets
`diagnostics.cache_miss_reason` in its response, from what the prompt cache really holds.

Owns `PromptRecords` (each diagnosed request's prompt tokens and the hashes of its system
prompt and tools, by message id; in memory, bounded) and `diagnose`.

The reason, in Anthropic's shape (`{"type", "cache_missed_input_tokens"}`), with the place
added (extra fields the SDKs keep): `diverged_at_token` (the first prompt token no cache entry
holds), `message_index` and `block_index` (the request's message and content block it falls
in; null for the system prompt and tools, or where a block cannot be told apart), `detail`.
  - no diagnosis asked for a previous message (`previous_message_id: null`), or the cache
    holds the whole previous prompt: `diagnostics: null`. Held counts both tiers: a prompt
    whose entry was evicted to the disk tier is still held there (the request loads it back,
    unless prefilling those tokens is faster: a choice of speed, not a miss), and the detail
    says which tokens are on disk;
  - the id was not recorded (never sent with `diagnostics`, dropped, another server):
    `previous_message_not_found`;
  - the divergence lies in the system prompt or tools region and the tools changed:
    `tools_changed`; the system prompt changed: `system_changed`;
  - the prompt repeats the previous one, but the cache no longer holds it (evicted, or a
    different `cache_salt`): `unavailable`;
  - otherwise `messages_changed`.
Reference: https://platform.claude.com/docs/en/build-with-claude/cache-diagnostics
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import FastAPI, Request

from mlxkv.cache.prefix import common_prefix_length

MAX_RECORDS = 64

# Where a template message came from: ("system", None) or (message index, block index|None).
Origin = tuple[Any, int | None]


@dataclass(frozen=True, kw_only=True)
class PromptRecord:
    tokens: np.ndarray  # (L,) uint32: the prompt as rendered
    system_hash: str
    tools_hash: str


class PromptRecords:
    """The last `max_records` diagnosed prompts, by message id (oldest dropped first)."""

    def __init__(self, max_records: int = MAX_RECORDS):
        self._max_records = max_records
        self._items: OrderedDict[str, PromptRecord] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, message_id: str) -> PromptRecord | None:
        with self._lock:
            return self._items.get(message_id)

    def put(self, message_id: str, record: PromptRecord) -> None:
        with self._lock:
            self._items[message_id] = record
            while len(self._items) > self._max_records:
                self._items.popitem(last=False)


def content_hash(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def diagnose(
    record: PromptRecord,
    previous: PromptRecord | None,
    held: int,
    locate: Callable[[int], tuple[int, Origin] | None],
    held_on_disk: int = 0,
) -> dict[str, Any] | None:
    """The `cache_miss_reason` for a prompt (`record`) of which the cache holds `held` leading
    tokens in memory and `held_on_disk` in its disk tier, against the previous request's
    (`previous`; None: not recorded); None when the cache holds the whole previous prompt.
    `locate(token)` tells which template message a token falls in, and where that message
    came from (None: unknown)."""
    if previous is None:
        return {"type": "previous_message_not_found"}
    where = ""
    if held_on_disk > held:
        where = f" ({held} in memory, the rest on disk)"
        held = held_on_disk
    expected = int(min(previous.tokens.size, record.tokens.size))
    if held >= expected:
        return None
    found = locate(held)
    # Templates render tools with the first message (the system prompt, if any).
    in_system = found is None or found[0] == 0
    origin = None if found is None else found[1]
    repeated = common_prefix_length(previous.tokens, record.tokens) >= expected
    if in_system and previous.tools_hash != record.tools_hash:
        kind, detail = "tools_changed", "the tools differ from the previous request's"
    elif in_system and previous.system_hash != record.system_hash:
        kind, detail = "system_changed", "the system prompt differs from the previous request's"
    elif repeated:
        kind = "unavailable"
        detail = (
            f"the prompt repeats the previous request's {expected} tokens, but the cache no "
            f"longer holds them past token {held} (evicted from memory and disk, or another "
            "cache_salt)"
        )
    else:
        kind, detail = "messages_changed", "the messages differ from the previous request's"
    message_index, block_index = (None, None) if origin is None else origin
    reason: dict[str, Any] = {"type": kind}
    if kind != "unavailable":
        reason["cache_missed_input_tokens"] = expected - held
    return {
        **reason,
        "diverged_at_token": held,
        "message_index": None if message_index == "system" else message_index,
        "block_index": block_index,
        "detail": f"{detail}; the cache holds the first {held} prompt tokens{where}",
    }


def make_locator(
    tokens: Sequence[int], origins: Sequence[Origin], encode_prefix: Callable[[int], list[int]]
) -> Callable[[int], tuple[int, Origin] | None]:
    """A function giving the template message (index, origin) that prompt token `at` falls
    in: message k - 1 for the first k whose rendering of messages[:k] agrees with `tokens`
    past `at` (binary search, about log2(len(origins)) renders; the generation prompt counts
    as the last message); None when a prefix cannot be rendered."""
    query = np.asarray(tokens, dtype=np.uint32)

    def covered(k: int) -> int:
        rendered = np.asarray(encode_prefix(k), dtype=np.uint32)
        return common_prefix_length(rendered, query)

    def locate(at: int) -> tuple[int, Origin] | None:
        low, high = 1, len(origins)
        try:
            while low < high:
                middle = (low + high) // 2
                if covered(middle) > at:
                    high = middle
                else:
                    low = middle + 1
        except ValueError:  # a template that refuses a prefix of the conversation
            return None
        return low - 1, origins[low - 1]

    return locate


def keep_prompt_records(app: FastAPI) -> None:
    """Gives `app` its diagnosed prompts (empty: a new server knows none)."""
    app.state.prompt_records = PromptRecords()


def prompt_records(request: Request) -> PromptRecords:
    """The diagnosed prompts of the app serving `request` (`keep_prompt_records`)."""
    return request.app.state.prompt_records
