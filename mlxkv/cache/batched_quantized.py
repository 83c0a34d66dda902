"""Quantized K/V of several rows decoding together: the batched class mlx-lm lacks.

Owns `BatchQuantizedKVCache`, laid out as mlx-lm's `BatchKVCache` (rows left-padded to one
length, per-row `offset` and `left_padding`, `_idx` the slots written) but storing each of keys
and values as the (packed words, scales, biases) triple mlxkv's `QuantizedKVCache` holds. Its
`bits` and `group_size` send mlx-lm's attention down `quantized_scaled_dot_product_attention`,
which applies the boolean mask `make_mask` builds (padding slots False), so a row never reads
another's padding. Does not own which layers batch or the conversion from and to an entry's
layers (`mlxkv.cache.batched`).

Invariants: every row's tokens end at slot `_idx`; row r's slots [left_padding[r], _idx) hold
its positions in order and the slots before them are zeros, masked; `offset[r]` is the row's
token count (RoPE position of its next token).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from mlxkv.cache.layers.base import DEFAULT_STEP_TOKENS, round_up
from mlxkv.cache.layers.quantized import QuantizedKVCache, Triple


class BatchQuantizedKVCache:
    """Quantized K/V of a decode batch's rows for one layer (see the module docstring).

    Args:
        group_size, bits: the rows' quantization (every row's must match).
        left_padding: padding slots before each row's first token.
    """

    step = DEFAULT_STEP_TOKENS

    def __init__(self, group_size: int, bits: int, left_padding: Sequence[int]):
        self.group_size = group_size
        self.bits = bits
        self.keys: Triple | None = None  # each (B, H, capacity, D * bits / 32 | D / group)
        self.values: Triple | None = None
        self.left_padding = mx.array(left_padding)
        self.offset = -self.left_padding
        self._idx = 0

    @classmethod
    def merge(cls, layers: Sequence[QuantizedKVCache]) -> BatchQuantizedKVCache:
        """`layers` (one per row, of one quantization) as rows, right-aligned at the longest;
        copied in, the layers unchanged."""
        first = layers[0]
        if any(
            (layer.bits, layer.group_size) != (first.bits, first.group_size) for layer in layers
        ):
            raise ValueError("rows of one batched layer must share kv_bits and kv_group_size")
        lengths = [layer.offset for layer in layers]
        longest = max(lengths)
        batch = cls(first.group_size, first.bits, [longest - n for n in lengths])
        if longest == 0:
            return batch
        held = [layer.state for layer in layers]
        like = next(state for state in held if state)
        batch.keys, batch.values = (
            _right_aligned([state[kv] if state else None for state in held], like[kv], longest)
            for kv in (0, 1)
        )
        batch.offset = batch.offset + longest
        batch._idx = longest
        return batch

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Triple, Triple]:
        """Quantizes `keys`/`values` (B, H, L, D), writes them after every row's last token
        and returns the triples of all `_idx` slots, padding included (masked by `make_mask`)."""
        prev, num_new = self._idx, keys.shape[2]
        q_keys = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        q_values = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        if self.keys is None or prev + num_new > self.keys[0].shape[2]:
            capacity = round_up(prev + num_new, self.step)
            self.keys = _grown(self.keys, q_keys, prev, capacity)
            self.values = _grown(self.values, q_values, prev, capacity)
        for stored, new in zip(self.keys + self.values, q_keys + q_values, strict=True):
            stored[..., prev : prev + num_new, :] = new
        self._idx = prev + num_new
        self.offset = self.offset + num_new
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[Triple, Triple]:
        """The triples of the `_idx` slots written, as the last `update_and_fetch` returned."""
        return _sliced(self.keys, 0, self._idx), _sliced(self.values, 0, self._idx)

    def make_mask(self, num_queries: int, return_array: bool = False, **kwargs) -> mx.array:
        """(B, 1, num_queries, _idx + num_queries) booleans: causal, and False on each row's
        padding slots (as `BatchKVCache.make_mask`); the quantized attention applies it with
        `mx.where`. `return_array` is taken for mlx-lm's call and moot: always an array."""
        return create_causal_mask(
            num_queries, offset=self._idx, left_padding=self.left_padding, **kwargs
        )

    def filter(self, batch_indices: mx.array) -> None:
        """Keeps the rows `batch_indices`, in that order, and drops the padding columns every
        kept row has (in place)."""
        if self.keys is not None:
            self.keys = tuple(a[batch_indices] for a in self.keys)
            self.values = tuple(a[batch_indices] for a in self.values)
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shared = min(self.left_padding.tolist())
        if shared > 0:
            if self.keys is not None:
                self.keys = _sliced(self.keys, shared, None)
                self.values = _sliced(self.values, shared, None)
            self._idx -= shared
            self.left_padding = self.left_padding - shared

    def extend(self, other: BatchQuantizedKVCache) -> None:
        """Appends `other`'s rows after these (in place), both right-aligned at the longer
        `_idx`: the shorter side gains left padding."""
        if (other.bits, other.group_size) != (self.bits, self.group_size):
            raise ValueError("rows of one batched layer must share kv_bits and kv_group_size")
        longest = max(self._idx, other._idx)
        like = self if self.keys is not None else other
        if like.keys is not None:
            for name in ("keys", "values"):
                parts = [
                    _front_padded(
                        getattr(side, name), side._idx, side.num_rows, getattr(like, name), longest
                    )
                    for side in (self, other)
                ]
                setattr(self, name, tuple(map(mx.concatenate, zip(*parts, strict=True))))
        self.left_padding = mx.concatenate(
            [self.left_padding + longest - self._idx, other.left_padding + longest - other._idx]
        )
        self.offset = mx.concatenate([self.offset, other.offset])
        self._idx = longest

    def extract(self, idx: int) -> QuantizedKVCache:
        """Row `idx` as a `QuantizedKVCache` of its own (copied: no view of the batch's
        buffers stays alive), its padding sliced off."""
        start = self.left_padding[idx].item()
        layer = QuantizedKVCache(self.group_size, self.bits)
        layer.state = tuple(
            tuple(mx.contiguous(a[idx : idx + 1, :, start : self._idx]) for a in triple)
            for triple in (self.keys, self.values)
        )
        return layer

    @property
    def num_rows(self) -> int:
        return self.offset.shape[0]

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers (padding and growth slack included)."""
        if self.keys is None:
            return 0
        return sum(a.nbytes for a in self.keys + self.values)


def _sliced(triple: Triple, start: int, stop: int | None) -> Triple:
    return tuple(a[..., start:stop, :] for a in triple)


def _right_aligned(rows: list[Triple | None], like: Triple, length: int) -> Triple:
    """One (B, H, length, ...) triple from the rows' (1, H, L_r, ...), each row's L_r slots at
    the end, zeros before (a row of None: all zeros)."""
    out = []
    for part, like_part in enumerate(like):
        buffer = mx.zeros(
            (len(rows), like_part.shape[1], length, like_part.shape[3]), like_part.dtype
        )
        for r, row in enumerate(rows):
            if row is not None:
                held = row[part].shape[2]
                buffer[r : r + 1, :, length - held :] = row[part]
        out.append(buffer)
    return tuple(out)


def _front_padded(triple: Triple | None, used: int, rows: int, like: Triple, length: int) -> Triple:
    """`triple`'s `used` slots behind `length - used` zero slots; `rows` rows of zeros
    shaped as `like` when there is no triple (a side that holds nothing yet)."""
    if triple is None:
        return tuple(mx.zeros((rows, a.shape[1], length, a.shape[3]), a.dtype) for a in like)
    pad = [(0, 0), (0, 0), (length - used, 0), (0, 0)]
    return tuple(mx.pad(a[..., :used, :], pad) for a in triple)


def _grown(old: Triple | None, like: Triple, num_used: int, capacity: int) -> Triple:
    """`old`'s first `num_used` slots in buffers of `capacity` slots, zeros after; shaped and
    typed as `like` (the new tokens' triple) when there is nothing yet."""
    grown = []
    for i, new in enumerate(like):
        shape = (*new.shape[:2], capacity, new.shape[3])
        buffer = mx.zeros(shape, new.dtype)
        if old is not None and num_used:
            buffer[..., :num_used, :] = old[i][..., :num_used, :]
        grown.append(buffer)
    return tuple(grown)
