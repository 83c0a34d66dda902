"""QuantizedKVCache: keys and values stored with `mx.quantize` (8 or 4 bits).

Owns: quantized storage of a global-attention layer. Each of keys and values is a triple
(packed uint32 words, scales, biases), one scale and bias per `group_size` elements of the head
dimension, which is the layout `mlx_lm.models.base.quantized_scaled_dot_product_attention` reads.
mlx-lm's attention takes the quantized path when the cache has a `bits` attribute.

Bytes per K/V element: bits/8 + 2 * scale_bytes / group_size (8-bit, group 64, float32 scales:
1.125 bytes; 4-bit: 0.625 bytes).

Invariants: as KVCache (slots [0, offset) hold positions 0..offset-1; trim is O(1); `shrink()`
gives memory back).
"""

from __future__ import annotations

import mlx.core as mx

from mlxkv.cache.layers.base import DEFAULT_STEP_TOKENS, ContiguousCache, resized_buffer, round_up
from mlxkv.config import check_kv_quantization

Triple = tuple[mx.array, mx.array, mx.array]


class QuantizedKVCache(ContiguousCache):
    """Quantized keys and values of one layer, grown `step` tokens at a time.

    Args:
        group_size: elements of the head dimension that share one scale and bias.
        bits: bits per stored element (8 or 4).
        step: growth granularity in tokens.
    """

    def __init__(self, group_size: int = 64, bits: int = 8, step: int = DEFAULT_STEP_TOKENS):
        check_kv_quantization(bits, group_size)
        self.group_size = group_size
        self.bits = bits
        self.step = step
        self.keys: Triple | None = None  # each (B, H, capacity, D * bits / 32 | D / group)
        self.values: Triple | None = None
        self.offset = 0

    # mlx-lm's pipeline-parallel models reassign the keys to `mx.depends(cache.keys, h)`,
    # which gives a list: kept as a triple, so they go on as any other.
    @property
    def keys(self) -> Triple | None:
        return self._keys

    @keys.setter
    def keys(self, triple) -> None:
        self._keys = None if triple is None else tuple(triple)

    @property
    def capacity_tokens(self) -> int:
        return 0 if self.keys is None else self.keys[0].shape[2]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Triple, Triple]:
        head_dim = keys.shape[-1]
        if head_dim % self.group_size:
            raise ValueError(
                f"head dimension {head_dim} is not a multiple of kv_group_size "
                f"{self.group_size}; choose a group size that divides it, or kv_bits=None"
            )
        prev = self.offset
        num_new = keys.shape[2]
        q_keys = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        q_values = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        if prev + num_new > self.capacity_tokens:
            self._reallocate(q_keys, q_values, round_up(prev + num_new, self.step))
        for stored, new in zip(self.keys + self.values, q_keys + q_values, strict=True):
            stored[..., prev : prev + num_new, :] = new
        self.offset = prev + num_new
        return self.keys_and_values()

    def _reallocate(self, keys: Triple, values: Triple, capacity: int) -> None:
        """Moves the used part into fresh buffers of `capacity` tokens (copies, never views,
        so the old buffers are freed)."""
        self.keys = _resized_triple(self.keys, keys, self.offset, capacity)
        self.values = _resized_triple(self.values, values, self.offset, capacity)

    def keys_and_values(self) -> tuple[Triple, Triple]:
        """The quantized K/V of every held token, as the last `update_and_fetch` returned them
        (for KV-shared layers)."""
        return self._used(self.keys), self._used(self.values)

    def _used(self, triple: Triple) -> Triple:
        return tuple(a[..., : self.offset, :] for a in triple)

    def dequantized(self) -> tuple[mx.array, mx.array]:
        """The held keys and values as float arrays (B, H, offset, D): for checks and export."""
        return tuple(
            mx.dequantize(*self._used(t), group_size=self.group_size, bits=self.bits)
            for t in (self.keys, self.values)
        )

    @property
    def state(self) -> tuple[Triple, Triple] | tuple[()]:
        if self.keys is None or self.offset == 0:
            return ()
        return self._used(self.keys), self._used(self.values)

    @state.setter
    def state(self, value) -> None:
        if not value:
            self.keys = self.values = None
            self.offset = 0
            return
        self.keys, self.values = (tuple(t) for t in value)
        self.offset = self.keys[0].shape[2]

    @property
    def meta_state(self) -> tuple[str, ...]:
        return (str(self.step), str(self.group_size), str(self.bits))

    @meta_state.setter
    def meta_state(self, value: tuple[str, ...]) -> None:
        self.step, self.group_size, self.bits = (int(v) for v in value)


def _resized_triple(old: Triple | None, like: Triple, num_used: int, capacity: int) -> Triple:
    parts = (None, None, None) if old is None else old
    return tuple(
        resized_buffer(o, new, num_used, capacity) for o, new in zip(parts, like, strict=True)
    )
