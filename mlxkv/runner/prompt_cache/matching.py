"""Which of the prompt cache's entries a request's tokens match, and how far.

Owns the lookup the pool runs for each request: the entry to reuse and how many tokens it
gives back (`nearest`: exactly, by trimming, from a checkpoint, or the exact part of a shift),
whether a prompt still being fed will hold more of the tokens than any entry yet
(`awaits_prefix`), the most tokens any entry holds of a prompt (`longest_prefix`) and which
entries are superseded (`superseded`). It only reads the entries: it does not own claiming,
trimming, copying or evicting them (`pool`), nor loads from the disk tier (`reuse`).

For a request's tokens T, r is the longest prefix of T an entry can return to exactly (by
trimming, or from a checkpoint for layers that cannot trim), at most len(T) - 1; of an entry
a context shift approximated in place, past the tokens it kept only when T goes on past all
it holds (`reuse.exact_part`; an exact retry does not, as on the disk tier). Lookups compare
T with each entry (vectorised).

Terms:
  in use       an entry a running request generates into, with the prompt that request feeds
               (`CachePool`'s marks); what its cache holds now is what it is matched as.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from mlxkv.cache.prefix import common_prefix_length, common_prefix_lengths
from mlxkv.runner.prompt_cache.entry import CacheEntry
from mlxkv.runner.prompt_cache.reuse import exact_part

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Nearest:
    """The entry a request reuses, and of the entry sharing the most with its tokens.

    Attributes:
        entry: the entry to reuse; None for none (a miss).
        reuse: tokens it gives back (0 for none).
        common: tokens the entry sharing the most shares (reusable or not).
        restorable: how many of those it can give back.
        held: the tokens it holds.
    """

    entry: CacheEntry | None
    reuse: int
    common: int
    restorable: int
    held: int

    def log_unreachable(self) -> None:
        """Says why the entry sharing the most gives back less than it shares, if it does."""
        if self.restorable < self.common:  # also with no checkpoint before it: a miss
            logger.info(
                "prefix cache: cannot go back from %d to %d tokens (recurrent or "
                "sliding-window layers no longer hold them); the nearest checkpoint is at %d",
                self.held,
                self.common,
                self.restorable,
            )


def nearest(
    entries: Sequence[CacheEntry],
    in_use: Mapping[CacheEntry, np.ndarray],
    query: np.ndarray,
    *,
    limit: int,
    salt: str | None,
    checkpointed: bool,
) -> Nearest:
    """The entry of `salt` to reuse for `query`, at most `limit` tokens of it; `checkpointed`:
    whether the entries' layers need checkpoints to go back (else they trim back to any)."""
    best, best_key, most = None, (0, False, 0.0), (0, 0, 0)
    entries = [entry for entry in entries if entry.salt == salt]
    # An entry in use: what its cache holds now (fed since, or moved by a shift).
    helds = [e.cache.tokens if e in in_use else e.tokens for e in entries]
    shared = common_prefix_lengths(query, helds)
    for entry, held, whole in zip(entries, helds, shared, strict=True):
        reuse = common = min(whole, limit)
        if checkpointed and 0 < reuse < len(held):
            reuse = entry.cache.nearest_restorable(reuse)
        goes_on = whole == len(held) < query.size  # past all it holds: not a retry
        reuse = exact_part(entry.cache, reuse, goes_on=goes_on)
        # the longest reuse; then one that needs no trim or copy; then the most recent, a
        # later choice's copy last
        key = (reuse, reuse == len(held) and entry not in in_use, not entry.evict_first)
        key += (entry.last_used,)
        most = max(most, (common, reuse, len(held)))
        if reuse and key > best_key:
            best, best_key = entry, key
    common, restorable, held = most
    return Nearest(best, best_key[0], common=common, restorable=restorable, held=held)


def awaits_prefix(
    entries: Sequence[CacheEntry],
    in_use: Mapping[CacheEntry, np.ndarray],
    query: np.ndarray,
    *,
    salt: str | None,
    checkpointed: bool,
) -> bool:
    """`CachePool.awaits_prefix` for the token ids `query`."""
    limit = query.size - 1
    coming = 0  # the most of `query` a prompt still being fed will hold
    for entry, prompt in in_use.items():
        held = entry.cache.num_tokens
        if entry.salt != salt or held >= prompt.size or entry not in entries:
            continue
        shared = min(common_prefix_length(prompt, query), limit)
        # not fed that far yet, and still feeding that prompt (not moved by a shift)
        if held < shared and common_prefix_length(entry.cache.tokens, prompt) == held:
            coming = max(coming, shared)
    if coming == 0:
        return False
    # Read last, only when worth it: it reads what every entry in use holds.
    found = nearest(entries, in_use, query, limit=limit, salt=salt, checkpointed=checkpointed)
    return found.reuse < coming


def longest_prefix(entries: Sequence[CacheEntry], query: np.ndarray, salt: str | None) -> int:
    """`CachePool.longest_prefix` for the token ids `query`."""
    helds = [e.tokens for e in list(entries) if e.salt == salt]
    return max(common_prefix_lengths(query, helds), default=0)


def superseded(entry: CacheEntry, entries: Sequence[CacheEntry]) -> bool:
    """Whether `entry`'s tokens are a strict prefix of another entry's (evicted first)."""
    return any(
        other.num_tokens > entry.num_tokens
        and common_prefix_length(other.tokens, entry.tokens) == entry.num_tokens
        for other in entries
    )
