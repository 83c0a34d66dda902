"""CacheEntry: one conversation's state in the prompt cache.

Owns `CacheEntry`, and `token_array` (ids as the uint32 array entries hold and are compared
as). Does not own which entry a request uses or when one is evicted (`pool`),
the bytes entries hold (`holdings`), nor how a request's `cache_salt` becomes the isolation
domain an entry belongs to (the request builder's).
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from mlxkv.cache.footprint import Footprint
from mlxkv.cache.model_cache import ModelCache
from mlxkv.runner.text.messages import Message

logger = logging.getLogger(__name__)

# The `array` typecode of a 4-byte unsigned int on this platform (None: none is, numpy then).
_UINT32 = next((code for code in "IL" if array(code).itemsize == 4), None)


def token_array(tokens: Sequence[int]) -> np.ndarray:
    """`tokens` as a uint32 array (a new one for a list; raises OverflowError for ids outside
    0..2**32-1). A list goes through the C `array` type: 0.4 ms for 15k ids against 1 ms for
    `np.asarray`, on the engine thread before a request's first token."""
    if isinstance(tokens, list) and _UINT32 is not None:
        return np.frombuffer(array(_UINT32, tokens), dtype=np.uint32)
    return np.asarray(tokens, dtype=np.uint32)


@dataclass(eq=False)
class CacheEntry:
    """One entry: a conversation's state. `tokens` is read at the end of each request (safe to
    read from any thread; `cache.tokens` is not while a generation runs). `label` names what the
    entry serves (a conversation id a client sent), shown; `keyed_by` is the label its last
    request gave (None: none), which a client deleting that conversation frees it by
    (`CachePool.drop_labelled`): lookup is by tokens alone. `cut_start` is the first message
    kept when the conversation was cut to the window (the request builder matches it), so its
    next turn cuts there again. `draft_cache` is the draft model's cache for this conversation
    (speculative decoding), counted in the entry's bytes. `salt` is the isolation domain the
    entry belongs to (a digest of a request's `cache_salt`, None for the shared one): only
    requests of the same salt reuse it. `went_on_in` is the copy a later request of the same
    conversation made while this entry was in use (of its whole prompt, a reply after it: the
    chat page's Stop then send), which takes its place when its request ends
    (`CachePool.release`). `evict_first`: a copy made for one of a request's later choices
    (`Runner.stream(evict_first=True)`), evicted before any other and matched last, until a
    request of its own reuses it (its client went on with that reply)."""

    cache: ModelCache
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint32))
    reply_start: int = 0
    last_used: float = field(default_factory=time.time)
    label: str | None = None
    keyed_by: str | None = None
    cut_start: Message | None = None
    draft_cache: ModelCache | None = None
    salt: str | None = None
    went_on_in: CacheEntry | None = field(default=None, repr=False)
    evict_first: bool = False

    # What `record` measured: the footprints of its cache and of its draft cache (None without
    # one). None while a request uses the entry (it changes as it is fed; the pool sets it)
    # and before its first record: `holdings` measures it then.
    recorded: tuple[Footprint, Footprint | None] | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.size)

    def record(self) -> int:
        """Takes as `tokens` the token ids its cache holds now, and as `recorded` their bytes,
        its caches materialized first (at a request's end, on the thread that generated into
        it, or after the pool changed it: the disk tier and other threads read them after);
        returns how many. A cache whose lazy arrays fail to evaluate is dropped, draft cache
        included: an entry never keeps a broken state."""
        try:  # a restore still being checked is evaluated by its first forward, not here
            held = self.cache.materialize() if self.cache.gate is None else self.cache.tokens
            footprint = self.cache.footprint()
            draft = None
            if self.draft_cache is not None:
                self.draft_cache.materialize()
                draft = self.draft_cache.footprint()
        except RuntimeError as error:  # a failed lazy computation
            logger.warning("prompt cache dropped: its arrays could not be evaluated (%s)", error)
            self.cache.free()
            self.draft_cache = draft = None
            held, footprint = [], self.cache.footprint()
        self.tokens = token_array(held)
        self.recorded = (footprint, draft)
        return self.num_tokens
