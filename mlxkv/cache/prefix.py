"""The prompt cache: one prefix-matched entry (a ModelCache and the token ids it holds).

Owns: deciding, for each request, how much of the entry to reuse. Longest common prefix between
the request's tokens and the entry's:
  - zero: free the entry and start fresh (a miss);
  - partial: trim the entry to the prefix (a hit), or, when a layer cannot go back that far
    (recurrent state, a sliding window that no longer holds the needed tokens), restore the
    nearest checkpoint before it, else free it and reprocess, logging why;
  - the whole request: keep all but its last token, because generation needs logits, which
    only come from feeding at least one token.

The entry is generated into in place, so after a request it holds exactly the tokens fed
through the model (ModelCache keeps its token list and K/V in step, even on exceptions).

Invariant: `fetch_nearest` returns at least one token still to feed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mlxkv.cache.model_cache import ModelCache

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefixHit:
    """What a request reuses and what it still has to feed.

    Attributes:
        cache: the entry, already trimmed to `num_cached` tokens.
        num_cached: tokens of the request whose K/V are reused.
        remaining: the request's tokens after those (never empty).
    """

    cache: ModelCache
    num_cached: int
    remaining: list[int]


class PrefixCache:
    """A single prompt-cache entry, matched by longest common prefix."""

    def __init__(self, entry: ModelCache):
        self.entry = entry

    def fetch_nearest(self, tokens: Sequence[int]) -> PrefixHit:
        """Prepares the entry for `tokens` and returns what is reused.

        Changes the entry in place (trims or frees it).

        Raises:
            ValueError: tokens is empty.
        """
        if not tokens:
            raise ValueError("cannot match an empty token sequence")
        held = self.entry.tokens
        common = common_prefix_length(held, tokens)
        reuse = min(common, len(tokens) - 1)
        if 0 < reuse < len(held):
            reachable = self.entry.nearest_restorable(reuse)
            if reachable < reuse:
                logger.info(
                    "prefix cache: cannot go back from %d to %d tokens (recurrent or "
                    "sliding-window layers no longer hold them); %s",
                    len(held),
                    reuse,
                    f"restoring the checkpoint at {reachable}" if reachable else "reprocessing",
                )
            reuse = reachable
        if reuse == 0:
            if held:
                self.entry.free()
            logger.info("prefix cache miss total=%d left=%d", len(tokens), len(tokens))
        else:
            trimmed = self.entry.rewind_to(reuse)
            # Keep allocation within one growth step of what is held after a large trim.
            freed = self.entry.shrink() if trimmed else 0
            logger.debug("prefix cache trim tokens=%d freed_bytes=%d", trimmed, freed)
            logger.info(
                "prefix cache hit total=%d cached=%d left=%d",
                len(tokens),
                reuse,
                len(tokens) - reuse,
            )
        return PrefixHit(self.entry, reuse, list(tokens[reuse:]))

    def clear(self) -> None:
        """Drops the entry's tokens and memory."""
        self.entry.free()


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences (vectorised)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differs = np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64)
    first = int(np.argmax(differs))
    return first if differs[first] else n
