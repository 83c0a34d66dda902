"""Random update / trim sequences on a ChunkedKVCache (Llama 4's chunked attention) against
the rule it must keep: a query at position q attends to exactly the positions of its own
chunk up to q, whatever was trimmed, dropped from the front or restored before."""

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mlxkv.cache import ChunkedKVCache
from mlxkv.errors import NotSupportedError
from tests.factories import assert_shared_view, make_kv, positions_of


class ChunkedMachine(RuleBasedStateMachine):
    @initialize(chunk=st.integers(1, 7))
    def setup(self, chunk):
        self.cache = ChunkedKVCache(chunk, step=3)
        self.chunk = chunk
        self.history: list[int] = []  # id of the token at each position
        self.next_id = 1000

    @precondition(lambda self: hasattr(self, "cache"))
    @rule(n=st.sampled_from([1, 1, 1, 2, 3, 5, 11]))
    def update(self, n):
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        self.cache.maybe_trim_front()  # as the model does before each forward
        mask = np.array(self.cache.make_mask(n))
        keys, values = self.cache.update_and_fetch(*make_kv(ids))
        assert_shared_view(self.cache, keys, values)
        start = len(self.history)
        self.history += ids
        held_ids = positions_of(keys)
        assert mask.shape == (n, len(held_ids))
        for i in range(n):
            q = start + i
            attended = [h for h, m in zip(held_ids, mask[i].tolist(), strict=True) if m]
            first = q // self.chunk * self.chunk
            assert attended == self.history[first : q + 1], f"query at position {q}"

    @precondition(lambda self: hasattr(self, "cache"))
    @rule(n=st.integers(0, 16))
    def trim(self, n):
        n = min(n, len(self.history))
        new_len = len(self.history) - n
        held = self._held_positions()
        front = held[0] if held else len(self.history)  # the oldest position held
        needed = set(range(new_len // self.chunk * self.chunk, new_len))
        possible = n == 0 or new_len == 0 or (needed <= set(held) and front <= new_len)
        assert self.cache.can_trim(n) == possible
        if possible:
            assert self.cache.trim(n) == n
            del self.history[new_len:]
        else:
            with pytest.raises(NotSupportedError, match="chunked-attention"):
                self.cache.trim(n)

    @precondition(lambda self: hasattr(self, "cache"))
    @rule()
    def restore_from_state(self):
        """A checkpoint's copy (state and meta_state) behaves as the original."""
        self.cache = ChunkedKVCache.from_state(self.cache.state, self.cache.meta_state)

    def _held_positions(self) -> list[int]:
        state = self.cache.state
        index = {token: p for p, token in enumerate(self.history)}
        return [index[t] for t in positions_of(state[0])] if state else []

    @precondition(lambda self: hasattr(self, "cache"))
    @invariant()
    def holds_a_contiguous_tail_within_two_chunks_of_the_front(self):
        assert self.cache.offset == len(self.history)
        held = self._held_positions()
        assert held == list(range(self.cache.start_position, self.cache.offset))
        assert self.cache.used_bytes <= self.cache.nbytes


def test_the_front_moves_a_whole_chunk_at_a_time_keeping_the_previous_chunk():
    cache = ChunkedKVCache(4, step=8)
    cache.update_and_fetch(*make_kv(range(11)))
    cache.maybe_trim_front()
    assert cache.start_position == 4  # chunks [4, 8) and [8, 12) kept
    assert cache.can_trim(11 - 4) and not cache.can_trim(11 - 3)


TestChunked = ChunkedMachine.TestCase
TestChunked.settings = settings(max_examples=120, stateful_step_count=30, deadline=None)
