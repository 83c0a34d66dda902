"""KVCache: one attention layer's keys and values, contiguous in time order.

Owns: the growable K/V buffer of a global-attention layer. Trim is O(1): it only moves the
offset; the slots past it are overwritten by the next update. `shrink()` gives memory back.

Invariants:
  - slots [0, offset) hold the K/V of positions 0..offset-1;
  - capacity is a multiple of `step` tokens (or exactly offset after `from_state` or
    `shrink(exact=True)`);
  - `state` is the used part only, so saved caches carry no padding.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from mlxkv.cache.layers.base import DEFAULT_STEP_TOKENS, ContiguousCache, resized_buffer, round_up

Rotation = Callable[[mx.array, int], mx.array]  # (keys (B, H, L, D), position delta) -> keys


class KVCache(ContiguousCache):
    """Keys and values of one layer, grown `step` tokens at a time.

    Args:
        step: growth granularity in tokens; larger steps mean fewer reallocations.
    """

    def __init__(self, step: int = DEFAULT_STEP_TOKENS):
        if step <= 0:
            raise ValueError(f"step must be a positive number of tokens, got {step}")
        self.step = step
        self.keys: mx.array | None = None  # (B, H, capacity, D)
        self.values: mx.array | None = None  # (B, H, capacity, Dv)
        self.offset = 0

    @property
    def capacity_tokens(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        prev = self.offset
        num_new = keys.shape[2]
        if prev + num_new > self.capacity_tokens:
            self._reallocate(keys, values, round_up(prev + num_new, self.step))
        self.keys[..., prev : prev + num_new, :] = keys
        self.values[..., prev : prev + num_new, :] = values
        self.offset = prev + num_new
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """The K/V of every held token, as the last `update_and_fetch` returned them: what a
        KV-shared layer (Gemma 3n, AFM) that reads this layer's cache attends to."""
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def _reallocate(self, keys: mx.array, values: mx.array, capacity: int) -> None:
        """Moves the used part into a fresh buffer of `capacity` tokens (a copy, never a view,
        so the old buffer is freed)."""
        self.keys = resized_buffer(self.keys, keys, self.offset, capacity)
        self.values = resized_buffer(self.values, values, self.offset, capacity)

    def shift(self, keep: int, drop: int, rotate: Rotation) -> None:
        """Removes positions [keep, keep + drop) and moves the later tokens back by `drop`.

        Their keys were rotated (RoPE) for their old positions; `rotate(keys, -drop)` must turn
        them into keys for the new ones. RoPE composes, so this is exact for the RoPE kinds
        whose rotation angle is linear in the position (see `mlxkv.runner.context`).
        Costs one copy of the held K/V.

        Raises:
            ValueError: the span is not inside the held tokens.
        """
        if keep < 0 or drop < 0 or keep + drop > self.offset:
            raise ValueError(
                f"cannot drop tokens {keep}..{keep + drop - 1}; the cache holds {self.offset}"
            )
        if drop == 0:
            return
        keys, values = self.state
        keys = mx.concatenate([keys[..., :keep, :], rotate(keys[..., keep + drop :, :], -drop)], 2)
        values = mx.concatenate([values[..., :keep, :], values[..., keep + drop :, :]], 2)
        held = keys.shape[2]
        self.keys = resized_buffer(keys, keys, held, round_up(held, self.step))
        self.values = resized_buffer(values, values, held, round_up(held, self.step))
        self.offset = held

    def to_quantized(self, group_size: int = 64, bits: int = 8):
        """A QuantizedKVCache holding the same tokens (lossy: see QuantizedKVCache)."""
        from mlxkv.cache.layers.quantized import QuantizedKVCache

        quantized = QuantizedKVCache(group_size=group_size, bits=bits, step=self.step)
        if self.offset:
            keys, values = self.state
            quantized.update_and_fetch(keys, values)
        return quantized

    @property
    def state(self) -> tuple[mx.array, mx.array] | tuple[()]:
        if self.keys is None or self.offset == 0:
            return ()
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    @state.setter
    def state(self, value: tuple[mx.array, mx.array] | tuple[()]) -> None:
        if not value:
            self.keys = self.values = None
            self.offset = 0
            return
        self.keys, self.values = value
        self.offset = self.keys.shape[2]

    @property
    def meta_state(self) -> tuple[str, ...]:
        return (str(self.step),)

    @meta_state.setter
    def meta_state(self, value: tuple[str, ...]) -> None:
        (self.step,) = (int(v) for v in value)
