"""`common_prefix_length` against a token-by-token scan, for lists (compared as slices) and
arrays (compared vectorised); `token_array` against numpy's own conversion."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlxkv.cache.prefix import common_prefix_length
from mlxkv.runner.prompt_cache.entry import token_array

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


@given(st.lists(st.integers(0, 2**32 - 1), max_size=40))
def test_token_array_equals_numpys_conversion(ids: list[int]) -> None:
    for given_ids in (ids, tuple(ids), np.asarray(ids, dtype=np.int64)):
        converted = token_array(given_ids)
        assert converted.dtype == np.uint32
        assert np.array_equal(converted, np.asarray(ids, dtype=np.uint32))
    converted = token_array(ids)
    if ids:  # a list's array is its own: writing it leaves the list as it was
        converted[0] = 7 if ids[0] != 7 else 8
        assert ids[0] != converted[0]


@pytest.mark.parametrize("bad", [-1, 2**32], ids=["negative", "past-32-bits"])
def test_token_array_refuses_ids_outside_32_bits(bad: int) -> None:
    with pytest.raises(OverflowError):
        token_array([1, bad])
