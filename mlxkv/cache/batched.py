"""Several entries' caches held as one batch, so that their sequences decode in one forward pass.

Owns `BatchedKV`: the per-layer caches of the sequences decoding together, in mlx-lm's batched
classes (left-padded rows with per-row offsets and masks, which mlx-lm's models read), with
`join` (an entry's layers become a new row, copied in), `merged` (several entries' at once,
empty ones included, for a batched prefill), `part` (a row's layers copied back out, the row
removed), `split` (every row's), a row's `snapshot` of its state layers (the disk tier's) and
`state_marks` (the recurrent arrays after a step, to go back to: `rewound_row`). Which layer
kinds join is `layer_batches`, the one place that decides it; `can_batch` and
`can_prefill_together` say it for a whole cache. Does not own the decode loop
(`mlxkv.decoding.batch`) or which entry a request uses (`pool`).

Each kind of ours converts to mlx-lm's batched class and back, rather than batching itself:
  float `KVCache`            <-> `BatchKVCache`;
  `SlidingWindowCache` (no sinks: `keep` 0)  <-> `BatchRotatingKVCache`: the held slots in time
      order, the newest `window` of them, as mlx-lm's `RotatingKVCache` lays them out;
  `QuantizedKVCache` (`kv_bits`) <-> our `BatchQuantizedKVCache` (mlx-lm has no batched
      quantized class): `BatchKVCache`'s layout holding the quantized triples;
  mlx-lm's `ArraysCache` (recurrent state) <-> its own `merge` / row slices;
  `CacheList` of these      <-> a `CacheList` of their batched classes.

Why copies rather than views: batched attention reads every row from one array, so each row's
K/V must live in it. The entry's own layers are left as they were when it joined, with the
token record that matches them; `part` hands the row's layers back to be adopted whole. So an
entry is consistent at every moment, even when a batched step fails, and other requests may
copy a shared prefix from it meanwhile.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    CacheList,
    RotatingKVCache,
)

from mlxkv.cache.batched_quantized import BatchQuantizedKVCache
from mlxkv.cache.layer_ops import always_trimmable, layer_can_trim, leaves
from mlxkv.cache.layers.kv import KVCache
from mlxkv.cache.layers.quantized import QuantizedKVCache
from mlxkv.cache.layers.window import SlidingWindowCache
from mlxkv.cache.model_cache import ModelCache


def layer_batches(layer: Any) -> bool:
    """Whether one layer's cache joins a decode batch: float or quantized K/V (`KVCache`,
    `QuantizedKVCache`), a `SlidingWindowCache` without sinks, mlx-lm's `ArraysCache`, or a
    `CacheList` of these. Out: chunked attention (no batched class for it), a window with
    `keep` sinks (`BatchRotatingKVCache` keeps none), a model's own state class."""
    if type(layer) is CacheList:
        return all(layer_batches(part) for part in layer.caches)
    if type(layer) is SlidingWindowCache:
        return layer.keep == 0
    return type(layer) in (KVCache, QuantizedKVCache, ArraysCache)


def can_batch(cache: ModelCache) -> bool:
    """True when every layer of `cache` joins a decode batch (`layer_batches`) and all are
    checked (no `gate`: a batch's pass evaluates every row's layers)."""
    return cache.gate is None and len(cache.layers) > 0 and all(map(layer_batches, cache.layers))


def can_prefill_together(cache: ModelCache, *, padded_state_exact: bool = False) -> bool:
    """True when `cache` may take part in a batched prefill (`prefill_together`): every layer
    a float `KVCache` or a `SlidingWindowCache` without sinks, or (`padded_state_exact`) every
    layer a float `KVCache` or mlx-lm's `ArraysCache`.

    That pass right-pads the prompts and rolls the padding out afterwards (`finalize`); it
    stops at each row's checkpoints to take them from the batch's rows, so windows and state
    come out with the checkpoints a plain prefill leaves. K/V and windows are exact in it
    (mlx-lm's `BatchRotatingKVCache` rolls too). Recurrent state is exact only where the
    model itself reads `ArraysCache.lengths` to stop before the padding: no cache can tell
    which, so the loaded model is probed once at load (`mlxkv.runner.assembly`), and
    `padded_state_exact` is its outcome. Out: quantized K/V (`BatchQuantizedKVCache` has no
    right padding to roll out), a `CacheList` and windows beside state (never probed: no
    model of the sweep mixes them with padding read), windows with `keep` sinks. Those
    caches prefill alone, then decode in the batch."""
    if not can_batch(cache):
        return False
    kinds = {type(layer) for layer in cache.layers}
    if SlidingWindowCache in kinds:
        return kinds <= {KVCache, SlidingWindowCache}
    return kinds <= ({KVCache, ArraysCache} if padded_state_exact else {KVCache})


class BatchedKV:
    """The layers of the rows decoding together; the model is called with `layers` as its cache.

    Rows are numbered in join order; `part` renumbers the rows after the one removed.
    """

    def __init__(self) -> None:
        self.layers: list[Any] = []
        self.num_rows = 0

    def join(self, cache: ModelCache) -> None:
        """Adds `cache`'s layers as the last row (unchanged itself).

        Raises:
            ValueError: `cache` cannot batch (see `can_batch`) or holds no tokens.
        """
        if not can_batch(cache) or cache.num_tokens == 0:
            raise ValueError("only a non-empty cache whose layers batch can join a batch")
        rows = BatchedKV.merged([cache]).layers
        if self.num_rows == 0:
            self.layers = rows
        else:
            for batch, row in zip(self.layers, rows, strict=True):
                batch.extend(row)
        self.num_rows += 1

    @classmethod
    def merged(cls, caches: Sequence[ModelCache]) -> BatchedKV:
        """`caches`' layers as rows, in order (copied in; the caches unchanged). Unlike `join`,
        an empty cache becomes a row too: prompts prefilled together may start from nothing.

        Raises:
            ValueError: no caches, or one cannot batch (see `can_batch`).
        """
        if not caches or not all(can_batch(cache) for cache in caches):
            raise ValueError("only caches whose layers batch can be merged into a batch")
        batched = cls()
        per_layer = zip(*(cache.layers for cache in caches), strict=True)
        batched.layers = [_merged(list(layers)) for layers in per_layer]
        batched.num_rows = len(caches)
        return batched

    def split(self, likes: Sequence[Sequence[Any]]) -> list[list[Any]]:
        """Every row's layers, each of the kind of `likes[row]`'s (the entry's own layers, for
        their window and growth step); the batch is left empty."""
        if len(likes) != self.num_rows:
            raise ValueError(f"{len(likes)} rows' layers for a batch of {self.num_rows} rows")
        rows = [self._row(row, like) for row, like in enumerate(likes)]
        self.layers, self.num_rows = [], 0
        return rows

    def part(self, row: int, like: Sequence[Any]) -> list[Any]:
        """Row `row`'s layers, of the kinds of `like` (its entry's), and the row removed."""
        layers = self._row(row, like)
        self.num_rows -= 1
        if self.num_rows == 0:
            self.layers = []
        else:
            kept = mx.array([i for i in range(self.num_rows + 1) if i != row])
            for batch in self.layers:
                batch.filter(kept)
        return layers

    def snapshot(self, row: int, like: Sequence[Any]) -> list[Any]:
        """Row `row`'s snapshot as `checkpoints.snapshot_layers` takes one (None for layers
        that trim back), lazy: the disk tier's at a block boundary the row crossed."""
        self._check(row)
        return [
            None if always_trimmable(own) else _row_layer(batch, row, own)
            for batch, own in zip(self.layers, like, strict=True)
        ]

    @property
    def has_state(self) -> bool:
        """True when some layer keeps recurrent state (it cannot trim back)."""
        return any(type(leaf) is ArraysCache for leaf in leaves(self.layers))

    def state_marks(self) -> list[Any]:
        """The recurrent arrays every row holds now, per layer (None for other kinds): MLX
        arrays are values and models replace these each step, so keeping them is keeping the
        state of this moment (`rewound_row`)."""
        return [_marks(batch) for batch in self.layers]

    def marks_nbytes(self, marks: Sequence[list[Any]]) -> int:
        """Bytes that `marks` (`state_marks` of earlier steps) keep alive besides the batch's
        own arrays, each array counted once (steps share the arrays of layers not replaced)."""
        own = {id(a) for a in _mark_arrays(self.state_marks())}
        kept = {id(a): a for a in _mark_arrays(marks) if id(a) not in own}
        return sum(a.nbytes for a in kept.values())

    def _check(self, row: int) -> None:
        if not 0 <= row < self.num_rows:
            raise IndexError(f"no row {row} in a batch of {self.num_rows}")

    def _row(self, row: int, like: Sequence[Any]) -> list[Any]:
        self._check(row)
        return [_row_layer(batch, row, own) for batch, own in zip(self.layers, like, strict=True)]

    @property
    def nbytes(self) -> int:
        """Bytes the batch's buffers hold (padding and growth slack included)."""
        return sum(batch.nbytes for batch in self.layers)


def rewound_row(layers: list[Any], marks: list[Any], row: int, drop: int) -> list[Any] | None:
    """`layers` (a row's, parted) without their last `drop` tokens: K/V layers trimmed, the
    recurrent ones set to the row `row` of `marks` (`BatchedKV.state_marks` taken where the
    row held that many fewer); None, with nothing changed, when a window cannot trim back."""
    if not all(layer_can_trim(leaf, drop) for leaf in _trimmed_leaves(layers)):
        return None
    return [_rewound(layer, mark, row, drop) for layer, mark in zip(layers, marks, strict=True)]


def _trimmed_leaves(layers: list[Any]) -> list[Any]:
    return [leaf for leaf in leaves(layers) if type(leaf) is not ArraysCache]


def _rewound(layer: Any, mark: Any, row: int, drop: int) -> Any:
    if type(layer) is CacheList:
        parts = zip(layer.caches, mark, strict=True)
        return CacheList(*(_rewound(c, m, row, drop) for c, m in parts))
    if type(layer) is ArraysCache:
        return _arrays_row(mark, row)
    layer.trim(drop)
    return layer


def _marks(batch: Any) -> Any:
    if type(batch) is CacheList:
        return [_marks(part) for part in batch.caches]
    return list(batch.cache) if type(batch) is ArraysCache else None


def _mark_arrays(marks: Any) -> Iterator[mx.array]:
    for mark in marks:
        if isinstance(mark, list):
            yield from _mark_arrays(mark)
        elif mark is not None:
            yield mark


def _arrays_row(arrays: Sequence[mx.array | None], row: int) -> ArraysCache:
    """Row `row` of recurrent arrays, copied: a slice would keep every row's arrays alive for
    as long as the entry holds it (measured: a view of one row of 8 held all 8)."""
    layer = ArraysCache(len(arrays))
    layer.cache = [None if a is None else mx.contiguous(a[row : row + 1]) for a in arrays]
    return layer


def _merged(layers: list[Any]) -> Any:
    """One layer position of several rows as mlx-lm's batched class for its kind."""
    first = layers[0]
    if type(first) is CacheList:
        parts = zip(*(layer.caches for layer in layers), strict=True)
        return CacheList(*(_merged(list(part)) for part in parts))
    if type(first) is ArraysCache:
        return ArraysCache.merge(layers)
    if type(first) is SlidingWindowCache:
        return _merged_windows(layers)
    if type(first) is QuantizedKVCache:
        return BatchQuantizedKVCache.merge(layers)
    return BatchKVCache.merge(layers)


def _merged_windows(layers: list[SlidingWindowCache]) -> BatchRotatingKVCache:
    """Windows as `BatchRotatingKVCache` rows. mlx-lm takes `min(offset, window)` slots from
    each; a window trimmed back may hold one fewer (the position no next token reads):
    that slot is zeros, counted as the row's left padding, so it is masked and never parted."""
    missing = []
    rotating = []
    for layer in layers:
        as_rotating = RotatingKVCache(layer.window)
        if layer.offset > 0:
            keys, values = layer.state  # (1, H, held, D) each, in time order
            gap = min(layer.offset, layer.window) - keys.shape[2]
            if gap > 0:
                pad = [(0, 0), (0, 0), (gap, 0), (0, 0)]
                keys, values = mx.pad(keys, pad), mx.pad(values, pad)
            # mlx-lm's state: keys, values, offset, keep, max_size and the write index
            held = keys.shape[2]
            as_rotating.state = (keys, values, layer.offset, 0, layer.window, held)
            missing.append(max(0, gap))
        else:
            missing.append(0)
        rotating.append(as_rotating)
    batch = BatchRotatingKVCache.merge(rotating)
    if any(missing):
        batch.left_padding = batch.left_padding + mx.array(missing)
    return batch


def _row_layer(batch: Any, row: int, like: Any) -> Any:
    """Row `row` of one batched layer as a layer of `like`'s kind (copied out)."""
    if type(batch) is CacheList:
        parts = zip(batch.caches, like.caches, strict=True)
        return CacheList(*(_row_layer(b, row, own) for b, own in parts))
    if type(batch) is ArraysCache:
        return _arrays_row(batch.cache, row)
    if type(batch) is BatchQuantizedKVCache:
        layer = batch.extract(row)  # copied out, padding sliced off
        layer.step = like.step
        return layer
    extracted = batch.extract(row)  # keys and values in time order, padding sliced off
    if type(batch) is BatchRotatingKVCache:
        layer = SlidingWindowCache(like.window, like.keep, like.step)
        layer.offset = extracted.offset
    else:
        layer = KVCache(like.step)
    layer.state = (extracted.keys, extracted.values)
    return layer
