"""What a prompt-cache lookup returns, and the longest-common-prefix measure it is made of.

Owns: `PrefixHit` and `common_prefix_length`. The lookup itself (which entry, trim, copy or
load) is `pool.CachePool.fetch_nearest`.

Invariant: a hit reuses at most all but the request's last token, because generation needs
logits, which only come from feeding at least one token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mlxkv.cache.model_cache import ModelCache


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


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences (vectorised)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differs = np.asarray(a[:n]) != np.asarray(b[:n])  # lists or arrays of ids
    first = int(np.argmax(differs))
    return first if differs[first] else n
