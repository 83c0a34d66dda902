"""Several entries' K/V held as one batch, so that their sequences decode in one forward pass.

Owns `BatchedKV`: the per-layer K/V of the sequences decoding together, in mlx-lm's
`BatchKVCache` (left-padded rows with per-row offsets and masks, which mlx-lm's models read),
with `join` (an entry's K/V become a new row, copied in), `merged` (several entries' at once,
empty ones included, for a batched prefill), `part` (a row's K/V copied back out, the row
removed) and `split` (every row's); `can_batch` says which caches can join. Does not own the
decode loop (`mlxkv.decoding.batch`) or which entry a request uses (`pool`).

Why copies rather than views: batched attention reads every row from one array, so each row's
K/V must live in it. The entry's own buffers are left as they were when it joined, with the
token record that matches them; `part` hands the row's K/V back to be adopted whole. So an
entry is consistent at every moment, even when a batched step fails, and other requests may
copy a shared prefix from it meanwhile.

Only float K/V layers batch: mlx-lm has no batched cache for quantized K/V, and this one's own
sliding-window and recurrent layers do not convert (those models decode one at a time).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from mlxkv.cache.layers.kv import KVCache
from mlxkv.cache.model_cache import ModelCache


def can_batch(cache: ModelCache) -> bool:
    """True when every layer of `cache` is a float `KVCache` (the only kind that joins) and
    all are checked (no `gate`: a batch's pass evaluates every row's layers)."""
    return (
        cache.gate is None
        and len(cache.layers) > 0
        and all(type(layer) is KVCache for layer in cache.layers)
    )


class BatchedKV:
    """The K/V of the rows decoding together; the model is called with `layers` as its cache.

    Rows are numbered in join order; `part` renumbers the rows after the one removed.
    """

    def __init__(self) -> None:
        self.layers: list[BatchKVCache] = []
        self.num_rows = 0

    def join(self, cache: ModelCache) -> None:
        """Adds `cache`'s K/V as the last row (unchanged itself).

        Raises:
            ValueError: `cache` cannot batch (see `can_batch`) or holds no tokens.
        """
        if not can_batch(cache) or cache.num_tokens == 0:
            raise ValueError("only a non-empty cache of float KVCache layers can join a batch")
        rows = BatchedKV.merged([cache]).layers
        if self.num_rows == 0:
            self.layers = rows
        else:
            for batch, row in zip(self.layers, rows, strict=True):
                batch.extend(row)
        self.num_rows += 1

    @classmethod
    def merged(cls, caches: Sequence[ModelCache]) -> BatchedKV:
        """`caches`' K/V as rows, in order (copied in; the caches unchanged). Unlike `join`,
        an empty cache becomes a row too: prompts prefilled together may start from nothing.

        Raises:
            ValueError: no caches, or one cannot batch (see `can_batch`).
        """
        if not caches or not all(can_batch(cache) for cache in caches):
            raise ValueError("only caches of float KVCache layers can be merged into a batch")
        batched = cls()
        per_layer = zip(*(cache.layers for cache in caches), strict=True)
        batched.layers = [BatchKVCache.merge(list(layers)) for layers in per_layer]
        batched.num_rows = len(caches)
        return batched

    def split(self, steps: Sequence[int]) -> list[list[KVCache]]:
        """Every row's K/V as one `KVCache` per layer (row i growing `steps[i]` tokens at a
        time); the batch is left empty."""
        if len(steps) != self.num_rows:
            raise ValueError(f"{len(steps)} growth steps for a batch of {self.num_rows} rows")
        rows = [self._row(row, step) for row, step in enumerate(steps)]
        self.layers, self.num_rows = [], 0
        return rows

    def part(self, row: int, step: int) -> list[KVCache]:
        """Row `row`'s K/V as one `KVCache` per layer (growing `step` tokens at a time), and
        the row removed from the batch."""
        layers = self._row(row, step)
        self.num_rows -= 1
        if self.num_rows == 0:
            self.layers = []
        else:
            kept = mx.array([i for i in range(self.num_rows + 1) if i != row])
            for batch in self.layers:
                batch.filter(kept)
        return layers

    def _row(self, row: int, step: int) -> list[KVCache]:
        """Row `row`'s K/V as one `KVCache` per layer, growing `step` tokens at a time."""
        if not 0 <= row < self.num_rows:
            raise IndexError(f"no row {row} in a batch of {self.num_rows}")
        layers = []
        for batch in self.layers:
            extracted = batch.extract(row)
            layer = KVCache(step)
            layer.state = (extracted.keys, extracted.values)
            layers.append(layer)
        return layers

    @property
    def nbytes(self) -> int:
        """Bytes the batch's K/V buffers hold (padding and growth slack included)."""
        return sum(batch.nbytes for batch in self.layers)
