"""Random update / trim / shrink sequences against a plain list of what each cache must hold."""

import hypothesis.strategies as st
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mlxkv.cache import KVCache, SlidingWindowCache
from mlxkv.cache.layers.base import round_up
from mlxkv.errors import NotSupportedError
from tests.factories import assert_shared_view, make_kv, positions_of

STEP = 4  # small, so sequences cross growth boundaries often


class KVCacheMachine(RuleBasedStateMachine):
    """Every token gets a unique id; the reference is the list of ids in position order."""

    def __init__(self):
        super().__init__()
        self.cache = KVCache(step=STEP)
        self.reference: list[int] = []
        self.next_id = 1000

    def _new_ids(self, n: int) -> list[int]:
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return ids

    @rule(n=st.integers(1, 9))
    def update(self, n):
        ids = self._new_ids(n)
        keys, values = self.cache.update_and_fetch(*make_kv(ids))
        assert_shared_view(self.cache, keys, values)
        self.reference += ids
        assert positions_of(keys) == self.reference
        assert positions_of(-values) == self.reference

    @rule(n=st.integers(0, 12))
    def trim(self, n):
        trimmed = self.cache.trim(n)
        assert trimmed == min(n, len(self.reference))
        del self.reference[len(self.reference) - trimmed :]

    @rule()
    def shrink(self):
        freed = self.cache.shrink()
        assert freed >= 0
        assert self.cache.capacity_tokens == round_up(len(self.reference), STEP)

    @invariant()
    def holds_the_reference(self):
        assert self.cache.offset == len(self.reference)
        state = self.cache.state
        assert (positions_of(state[0]) if state else []) == self.reference
        capacity = self.cache.capacity_tokens
        assert capacity % STEP == 0 and capacity >= self.cache.offset
        if self.cache.keys is not None:
            assert self.cache.nbytes == self.cache.keys.nbytes + self.cache.values.nbytes
            per_token = self.cache.nbytes // capacity
            assert self.cache.used_bytes == per_token * self.cache.offset


class WindowMachine(RuleBasedStateMachine):
    """Checks what each query attends to (keys selected by the mask) against the window rule."""

    @initialize(window=st.integers(2, 9), keep=st.integers(0, 2), narrower=st.integers(0, 3))
    def setup(self, window, keep, narrower):
        keep = min(keep, window - 1)
        self.cache = SlidingWindowCache(window, keep=keep, step=2)
        self.window, self.keep = window, keep
        # Models may ask for a window narrower than the cache holds (mlx-lm allows it).
        self.mask_window = max(keep + 1, window - narrower)
        self.history: list[int] = []  # id of the token at each position
        self.next_id = 1000

    @precondition(lambda self: hasattr(self, "cache"))
    @rule(n=st.sampled_from([1, 1, 1, 2, 3, 5, 11]))
    def update(self, n):
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        mask = self.cache.make_mask(n, window_size=self.mask_window)
        keys, values = self.cache.update_and_fetch(*make_kv(ids))
        assert_shared_view(self.cache, keys, values)
        mask = _as_array(mask, n, keys.shape[2])
        start = len(self.history)
        self.history += ids
        held_ids = positions_of(keys)
        assert positions_of(-values) == held_ids
        for i in range(n):
            attended = sorted(h for h, m in zip(held_ids, mask[i].tolist(), strict=True) if m)
            assert attended == sorted(self._expected(start + i)), f"query at position {start + i}"

    def _expected(self, q: int) -> list[int]:
        ring = self.mask_window - self.keep
        return [self.history[p] for p in range(q + 1) if p < self.keep or p > q - ring]

    @precondition(lambda self: hasattr(self, "cache"))
    @rule(n=st.integers(0, 14))
    def trim(self, n):
        held = self._held_positions()
        new_len = len(self.history) - min(n, len(self.history))
        ring = self.window - self.keep
        needed = {p for p in range(new_len) if p < self.keep or p > new_len - ring}
        possible = needed <= held
        assert self.cache.can_trim(min(n, len(self.history))) == possible
        if possible:
            self.cache.trim(n)
            del self.history[new_len:]
        else:
            with pytest.raises(NotSupportedError):
                self.cache.trim(n)

    def _held_positions(self) -> set[int]:
        state = self.cache.state
        index = {token: p for p, token in enumerate(self.history)}
        return {index[t] for t in positions_of(state[0])} if state else set()

    @precondition(lambda self: hasattr(self, "cache"))
    @invariant()
    def bounded_and_in_order(self):
        assert self.cache.offset == len(self.history)
        state = self.cache.state
        held = positions_of(state[0]) if state else []
        index = {token: p for p, token in enumerate(self.history)}
        assert [index[t] for t in held] == sorted(index[t] for t in held)
        if self.cache.capacity_tokens <= self.window:
            assert len(held) <= self.window


def _as_array(mask, n: int, num_keys: int):
    """The mask as a (n, num_keys) boolean numpy array (None and "causal" expanded)."""
    if mask is None:
        return np.ones((n, num_keys), dtype=bool)
    if isinstance(mask, str):
        q = np.arange(num_keys - n, num_keys)[:, None]
        return q >= np.arange(num_keys)[None]
    return np.array(mask) if isinstance(mask, mx.array) else mask


TestKVCache = KVCacheMachine.TestCase
TestKVCache.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestWindow = WindowMachine.TestCase
TestWindow.settings = settings(max_examples=120, stateful_step_count=30, deadline=None)
