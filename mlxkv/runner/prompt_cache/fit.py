"""Keeping one entry within a byte budget by its longest prefix that fits.

Owns `fit_to_budget`, what the pool does with the last entry left when it alone is over the
budget: the next turn of that conversation still reuses its system prompt and most of its
history, instead of nothing. Does not own which entry is evicted (`pool`).
"""

from __future__ import annotations

import logging

from mlxkv.runner.disk.store import DiskStore
from mlxkv.runner.prompt_cache.entry import CacheEntry
from mlxkv.runner.prompt_cache.holdings import holdings

logger = logging.getLogger(__name__)

# Aim this far under the budget, for at most this many rounds (checkpoints and recurrent state
# do not shrink with the tokens, so one trim may not be enough).
_FIT_MARGIN = 0.95
_FIT_ROUNDS = 4


def fit_to_budget(entry: CacheEntry, max_bytes: int, store: DiskStore | None) -> bool:
    """Brings `entry` within `max_bytes`: its draft-model cache dropped first, then its
    longest prefix that fits kept (the whole entry written to `store` before, for a later
    request that needs all of it).

    Returns:
        False when not even a prefix fits (the entry, already written to `store`, is for the
        caller to drop) or its arrays failed to evaluate (`CacheEntry.record`), else True.
    """
    if holdings([entry]).held_bytes <= max_bytes:
        return True
    entry.draft_cache = None  # the draft model catches up again when it is needed
    if entry.record() == 0:  # its arrays failed to evaluate: dropped, not kept
        return False
    held = holdings([entry]).held_bytes
    if held <= max_bytes:
        return True
    cache, total = entry.cache, entry.num_tokens
    # every slot past the tokens freed, not just past their growth step: a budget under one
    # step (256 tokens) keeps what fits, not nothing, and the trims below are sized by it
    cache.shrink(exact=True)
    if entry.record() == 0:
        return False
    if (held := holdings([entry]).held_bytes) <= max_bytes:
        return True
    if store is not None:
        store.write(cache, salt=entry.salt, reply_start=entry.reply_start)
    kept = total
    for _ in range(_FIT_ROUNDS):
        kept = cache.nearest_restorable(int(kept * _FIT_MARGIN * max_bytes / held))
        if kept == 0:
            break
        cache.rewind_to(kept)
        cache.shrink(exact=True)
        if entry.record() == 0:
            return False
        held = holdings([entry]).held_bytes
        if held <= max_bytes:
            entry.reply_start = min(entry.reply_start, kept)
            logger.info(
                "prefix cache: an entry of %d tokens is over the budget (%d bytes); kept its "
                "first %d tokens",
                total,
                max_bytes,
                kept,
            )
            return True
    return False
