"""`common_prefix_length` against a token-by-token scan, for lists (compared as slices) and
arrays (compared vectorised)."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from mlxkv.cache.prefix import common_prefix_length

_IDS = st.lists(st.integers(0, 3), max_size=40)


def _scanned(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@given(_IDS, st.integers(0, 40), _IDS)
def test_common_prefix_length_matches_a_scan(a: list[int], shared: int, tail: list[int]) -> None:
    b = a[:shared] + tail  # most pairs share a prefix, of every length
    want = _scanned(a, b)
    assert common_prefix_length(a, b) == want
    assert common_prefix_length(b, a) == want
    assert common_prefix_length(np.asarray(a, dtype=np.uint32), b) == want
