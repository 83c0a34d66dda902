"""The longest-common-prefix measure prompt-cache lookups are made of.

Owns `common_prefix_length`, and `common_prefix_lengths` for one sequence against several. The
lookup itself (which entry, trim, copy or load) and what it returns (`PrefixHit`) are
`pool.CachePool.fetch_nearest`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences (vectorised)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differs = np.asarray(a[:n]) != np.asarray(b[:n])  # lists or arrays of ids
    first = int(np.argmax(differs))
    return first if differs[first] else n


def common_prefix_lengths(query: Sequence[int], candidates: Sequence[Sequence[int]]) -> list[int]:
    """`common_prefix_length` of `query` with each of `candidates` (a lookup over entries)."""
    return [common_prefix_length(query, candidate) for candidate in candidates]
