"""ChunkedKVCache: K/V of a chunked-attention layer (Llama 4), whose queries attend only to
earlier tokens of their own chunk of `chunk_size` positions.

Owns: storage for those layers, mlx-lm's `ChunkedKVCache` protocol (`maybe_trim_front`, which
the model calls before each forward pass, and `start_position`, the position of the oldest
token held, from which the model builds its chunk mask). Does not own the mask (the model
builds it).

Terms:
  chunk  positions [k * chunk_size, (k + 1) * chunk_size); a query sees its own chunk only.

Layout: slots [0, offset - start_position) hold positions [start_position, offset) in time order.
`maybe_trim_front` keeps the current and the previous chunk (mlx-lm keeps the last
`chunk_size` tokens): at most 2 * chunk_size tokens plus a prefill batch are held, the front
moves a whole chunk at a time (one copy per chunk, not one per token), and a trim can always
go back into the previous chunk.

Invariants:
  - `trim(n)` goes back only when the new position's chunk is still held (`can_trim`), or to
    position 0; otherwise it raises `NotSupportedError` (checkpoints restore further back);
  - a forward pass that started at `offset` can always be trimmed back to it.
"""

from __future__ import annotations

import mlx.core as mx

from mlxkv.cache.layers.base import (
    DEFAULT_STEP_TOKENS,
    BufferedCache,
    check_trim_count,
    resized_buffer,
    round_up,
    state_errors,
)
from mlxkv.errors import NotSupportedError


class ChunkedKVCache(BufferedCache):
    """Keys and values of a chunked-attention layer.

    Args:
        chunk_size: positions per attention chunk (the model's `attention_chunk_size`).
        step: growth granularity in tokens.
    """

    def __init__(self, chunk_size: int, step: int = DEFAULT_STEP_TOKENS):
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size}")
        self.chunk_size = chunk_size
        self.step = step
        self.keys: mx.array | None = None  # (B, H, capacity, D)
        self.values: mx.array | None = None
        self.offset = 0
        self.start_position = 0

    @property
    def capacity_tokens(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def _num_held(self) -> int:
        return self.offset - self.start_position

    def _chunk_start(self, position: int) -> int:
        return position // self.chunk_size * self.chunk_size

    # -- model-facing ---------------------------------------------------------------------

    def maybe_trim_front(self) -> None:
        """Drops the chunks before the previous one (called by the model before a forward)."""
        new_start = max(0, self._chunk_start(self.offset) - self.chunk_size)
        if self.keys is None or new_start <= self.start_position:
            return
        drop = new_start - self.start_position
        held = self._num_held - drop
        capacity = round_up(max(held, 1), self.step)
        self.keys = resized_buffer(self.keys[..., drop:, :], self.keys, held, capacity)
        self.values = resized_buffer(self.values[..., drop:, :], self.values, held, capacity)
        self.start_position = new_start

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        prev, num_new = self._num_held, keys.shape[2]
        if prev + num_new > self.capacity_tokens:
            capacity = round_up(prev + num_new, self.step)
            self.keys = resized_buffer(self.keys, keys, prev, capacity)
            self.values = resized_buffer(self.values, values, prev, capacity)
        self.keys[..., prev : prev + num_new, :] = keys
        self.values[..., prev : prev + num_new, :] = values
        self.offset += num_new
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """The held K/V (positions start_position..offset-1), as `update_and_fetch` returned."""
        return self.keys[..., : self._num_held, :], self.values[..., : self._num_held, :]

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array:
        """Boolean (N, held + N) mask: a query sees the earlier tokens of its own chunk."""
        key_pos = mx.arange(self.start_position, self.offset + N)[None]
        query_pos = mx.arange(self.offset, self.offset + N)[:, None]
        same_chunk = key_pos // self.chunk_size == query_pos // self.chunk_size
        return (key_pos <= query_pos) & same_chunk

    # -- management -----------------------------------------------------------------------

    def can_trim(self, n: int) -> bool:
        """True when going back n tokens leaves the new position's chunk held (or empties)."""
        if n < 0 or n > self.offset:
            return False
        new_offset = self.offset - n
        return n == 0 or new_offset == 0 or self.start_position <= self._chunk_start(new_offset)

    def is_trimmable(self) -> bool:
        return self.can_trim(1)

    def trim(self, n: int) -> int:
        check_trim_count(n)
        n = min(n, self.offset)
        if not self.can_trim(n):
            raise NotSupportedError(
                f"cannot trim {n} tokens: this chunked-attention cache ({self.chunk_size}-token "
                f"chunks) holds positions {self.start_position}..{self.offset - 1}, but position "
                f"{self.offset - n} needs its chunk from {self._chunk_start(self.offset - n)}. "
                "Check can_trim(n) first, or restore a checkpoint"
            )
        self.offset -= n
        if self.offset == 0:
            self.start_position = 0
        return n

    def to_quantized(self, group_size: int = 64, bits: int = 8):
        raise NotSupportedError(
            "quantizing a chunked-attention cache is not supported; its memory is already "
            f"bounded by two chunks ({2 * self.chunk_size} tokens)"
        )

    @property
    def state(self) -> tuple[mx.array, mx.array] | tuple[()]:
        if self.keys is None or self._num_held == 0:
            return ()
        return self.keys_and_values()

    @state.setter
    def state(self, value) -> None:
        """Sets the held tokens; set `meta_state` (offset, start) first."""
        self.keys, self.values = value if value else (None, None)

    @property
    def meta_state(self) -> tuple[str, ...]:
        fields = (self.offset, self.start_position, self.chunk_size, self.step)
        return tuple(str(v) for v in fields)

    @meta_state.setter
    def meta_state(self, value: tuple[str, ...]) -> None:
        self.offset, self.start_position, self.chunk_size, self.step = (int(v) for v in value)

    @classmethod
    def from_state(cls, state, meta_state: tuple[str, ...]) -> ChunkedKVCache:
        """Rebuilds a cache from `state` and `meta_state`.

        Raises:
            CacheStateError: they are not what a ChunkedKVCache saves.
        """
        with state_errors(cls.__name__):
            _, _, chunk_size, step = (int(v) for v in meta_state)
            cache = cls(chunk_size, step)
            cache.meta_state = meta_state
            cache.state = state
        return cache

    def size(self) -> int:
        return self._num_held

    def _used_slots(self) -> int:
        return self._num_held
