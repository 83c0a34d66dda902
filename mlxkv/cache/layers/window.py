"""SlidingWindowCache: K/V of a sliding-window attention layer, a ring buffer once full.

Owns: storage for layers whose queries attend only to the last `window` positions, plus
optionally `keep` "sink" tokens (the first positions, always attended to). Memory stays bounded:
at most `window` slots while decoding; a prefill chunk of L tokens briefly holds
`window - 1 + L`, because each of its tokens needs the `window - 1` before it.

Terms:
  ring window  `window - keep` positions: the non-sink tokens a query attends to, itself included.
  slot         a place in the buffer; slot order differs from time order once the ring wraps.

Layout: slots [0, num_sinks) hold positions [0, num_sinks); the other held tokens are the
positions [oldest, offset). In time order they start at slot `_idx`, wrapping from the last slot
back to slot `keep`; `_idx == keep` means the buffer is in time order. It wraps only while every
slot is in use and the buffer has exactly `window` slots.

Invariants:
  - `trim(n)` goes back only when the tokens position `offset - n` needs are all still held
    (`can_trim`); otherwise it raises `NotSupportedError` rather than return wrong history;
  - masks are built from the position each slot holds, so they are exact in either order.
"""

from __future__ import annotations

import mlx.core as mx

from mlxkv.cache.layers.base import (
    DEFAULT_STEP_TOKENS,
    BufferedCache,
    causal_mask,
    check_trim_count,
    resized_buffer,
    state_errors,
)
from mlxkv.errors import NotSupportedError


class SlidingWindowCache(BufferedCache):
    """Keys and values of a sliding-window layer.

    Args:
        window: positions a query attends to, itself and the sinks included (the model's
            sliding window, e.g. 4096 tokens).
        keep: sink tokens at the start that are never evicted (0 for ordinary window layers).
        step: growth granularity in tokens while the buffer is smaller than the window.
    """

    def __init__(self, window: int, keep: int = 0, step: int = DEFAULT_STEP_TOKENS):
        if window <= 0:
            raise ValueError(f"window must be a positive number of tokens, got {window}")
        if not 0 <= keep < window:
            raise ValueError(f"keep must be in [0, window); got keep={keep}, window={window}")
        self.window = window
        self.keep = keep
        self.step = step
        self.keys: mx.array | None = None  # (B, H, slots, D)
        self.values: mx.array | None = None
        self.offset = 0
        self._num_slots = 0  # slots in use, sinks included
        self._idx = keep  # slot of the oldest non-sink token

    # -- positions ------------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def _ring_window(self) -> int:
        return self.window - self.keep

    @property
    def _num_sinks(self) -> int:
        return min(self.keep, self.offset)

    @property
    def oldest_position(self) -> int:
        """Position of the oldest non-sink token held (== offset when none is held)."""
        return self.offset - (self._num_slots - self._num_sinks)

    def _takes_chunk_path(self, num_new: int) -> bool:
        return num_new > 1 or self.capacity_tokens > self.window

    def _chunk_drop(self) -> int:
        """Oldest non-sink tokens a chunk update evicts: it keeps `ring window - 1` of them."""
        held_ring = self._num_slots - self._num_sinks
        return max(0, held_ring - (self._ring_window - 1))

    # -- model-facing ---------------------------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        num_new = keys.shape[2]
        if self._takes_chunk_path(num_new):
            self._append_chunk(keys, values)
        else:
            self._append_one(keys, values)
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """The held K/V in slot order, as the last `update_and_fetch` returned them: a
        KV-shared layer reading this cache uses the mask made for the owner's update."""
        if self._num_slots == self.capacity_tokens:
            return self.keys, self.values
        return self.keys[..., : self._num_slots, :], self.values[..., : self._num_slots, :]

    def _append_chunk(self, keys: mx.array, values: mx.array) -> None:
        """Time-orders the buffer, evicts what no new token needs, and appends the chunk."""
        sinks, drop = self._num_sinks, self._chunk_drop()

        def rebuilt(buffer: mx.array | None, new: mx.array) -> mx.array:
            if buffer is None:
                return new
            ordered = self._time_ordered(buffer)
            kept = [ordered[..., :sinks, :], ordered[..., sinks + drop :, :]]
            return mx.concatenate([*kept, new], axis=2)

        self.keys = rebuilt(self.keys, keys)
        self.values = rebuilt(self.values, values)
        self._num_slots = self.keys.shape[2]
        self._idx = self.keep
        self.offset += keys.shape[2]

    def _append_one(self, keys: mx.array, values: mx.array) -> None:
        capacity = self.capacity_tokens
        if self._overwrites_oldest(1):
            slot = self._idx  # overwrite the oldest non-sink token
            self._idx = self.keep + (self._idx + 1 - self.keep) % self._ring_window
        else:
            if self._num_slots == capacity:
                grown = min(capacity + self.step, self.window)
                self.keys = resized_buffer(self.keys, keys, self._num_slots, grown)
                self.values = resized_buffer(self.values, values, self._num_slots, grown)
            slot = self._num_slots
            self._num_slots += 1
        self.keys[..., slot : slot + 1, :] = keys
        self.values[..., slot : slot + 1, :] = values
        self.offset += 1

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array | str | None:
        """Mask for the next update of N tokens, in the slot order that update will return."""
        window = window_size or self.window
        first_ring = self._first_ring_after(N)
        all_held_in_order = first_ring == self._num_sinks
        if all_held_in_order and (self.keep == 0 or self.offset + N <= window):
            return causal_mask(N, self.offset, window, return_array)
        if N == 1 and not return_array and first_ring > self.offset - (window - self.keep):
            return None  # every held token is inside the window
        return self._positions_mask(N, first_ring, window)

    def _overwrites_oldest(self, num_new: int) -> bool:
        return (
            not self._takes_chunk_path(num_new)
            and self._num_slots == self.capacity_tokens == self.window
        )

    def _first_ring_after(self, num_new: int) -> int:
        """Position of the oldest non-sink token held once `num_new` tokens are appended."""
        if self._takes_chunk_path(num_new):
            return self.oldest_position + self._chunk_drop()
        return self.oldest_position + self._overwrites_oldest(num_new)

    def _positions_mask(self, N: int, first_ring: int, window: int) -> mx.array:
        """Boolean (N, slots) mask from the position each slot will hold after the update."""
        sinks = mx.arange(self._num_sinks)
        ring = mx.arange(first_ring, self.offset + N)
        if self._overwrites_oldest(N):
            next_idx = self.keep + (self._idx + 1 - self.keep) % self._ring_window
            ring = mx.roll(ring, next_idx - self.keep)
        key_pos = mx.concatenate([sinks, ring])[None]
        query_pos = mx.arange(self.offset, self.offset + N)[:, None]
        in_window = (key_pos > query_pos - (window - self.keep)) | (key_pos < self.keep)
        return (key_pos <= query_pos) & in_window

    # -- management -----------------------------------------------------------------------

    def can_trim(self, n: int) -> bool:
        """True when going back n tokens leaves every position the next token needs held."""
        if n < 0 or n > self.offset:
            return False
        new_offset = self.offset - n
        if n == 0 or new_offset <= self.keep:
            return True
        needed_from = max(self.keep, new_offset - self._ring_window + 1)
        return needed_from >= new_offset or self.oldest_position <= needed_from

    def is_trimmable(self) -> bool:
        return self.can_trim(1)

    def trim(self, n: int) -> int:
        check_trim_count(n)
        n = min(n, self.offset)
        if not self.can_trim(n):
            new_offset = self.offset - n
            raise NotSupportedError(
                f"cannot trim {n} tokens: this sliding window of {self.window} tokens holds "
                f"positions {self.oldest_position}..{self.offset - 1} (and {self._num_sinks} "
                f"sinks), but a token at position {new_offset} needs positions from "
                f"{max(self.keep, new_offset - self._ring_window + 1)}. Check can_trim(n) "
                "first, or clear the cache and prefill again"
            )
        if n == 0:
            return 0
        new_offset = self.offset - n
        kept = min(self._num_sinks, new_offset) + max(0, new_offset - self.oldest_position)
        self.keys = self._time_ordered(self.keys)
        self.values = self._time_ordered(self.values)
        self._idx = self.keep
        self._num_slots = kept
        self.offset = new_offset
        return n

    def _time_ordered(self, buffer: mx.array) -> mx.array:
        """The used slots in time order (a view when already ordered, else a copy)."""
        if self._idx == self.keep:
            return buffer[..., : self._num_slots, :]
        k, i = self.keep, self._idx
        return mx.concatenate([buffer[..., :k, :], buffer[..., i:, :], buffer[..., k:i, :]], 2)

    def to_quantized(self, group_size: int = 64, bits: int = 8):
        raise NotSupportedError(
            "quantizing a sliding-window cache is not supported; its memory is already bounded "
            f"by the window ({self.window} tokens)"
        )

    @property
    def state(self) -> tuple[mx.array, mx.array] | tuple[()]:
        if self.keys is None or self._num_slots == 0:
            return ()
        return self._time_ordered(self.keys), self._time_ordered(self.values)

    @state.setter
    def state(self, value) -> None:
        """Sets the held tokens in time order; set `meta_state` (it carries the offset) first."""
        self.keys, self.values = value if value else (None, None)
        self._num_slots = self.capacity_tokens
        self._idx = self.keep

    @property
    def meta_state(self) -> tuple[str, ...]:
        return tuple(str(v) for v in (self.offset, self.window, self.keep, self.step))

    @meta_state.setter
    def meta_state(self, value: tuple[str, ...]) -> None:
        self.offset, self.window, self.keep, self.step = (int(v) for v in value)

    @classmethod
    def from_state(cls, state, meta_state: tuple[str, ...]) -> SlidingWindowCache:
        """Rebuilds a cache from `state` and `meta_state`.

        Raises:
            CacheStateError: they are not what a SlidingWindowCache saves.
        """
        with state_errors(cls.__name__):
            _, window, keep, step = (int(v) for v in meta_state)
            cache = cls(window, keep, step)
            cache.meta_state = meta_state
            cache.state = state
        return cache

    def size(self) -> int:
        return self._num_slots

    def _used_slots(self) -> int:
        return self._num_slots
