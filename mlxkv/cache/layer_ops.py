"""Operations on one layer's cache, whatever its kind: mlxkv's K/V classes and mlx-lm's
recurrent (`ArraysCache`) and container (`CacheList`) layers.

Owns: copying a layer, listing its arrays and its bytes, whether and how far it can trim, and
marking a layer's state before a forward pass so the pass can be undone (`mark_layer`,
`restore_layer`). These take a container as one layer (they recurse into it), so a ModelCache
walks only its own list. Does not own the token bookkeeping that keeps layers and token ids in
step (`model_cache.ModelCache`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import cache as mlx_cache

from mlxkv.cache.layers.chunked import ChunkedKVCache
from mlxkv.cache.layers.kv import KVCache
from mlxkv.cache.layers.quantized import QuantizedKVCache
from mlxkv.cache.layers.window import SlidingWindowCache


def is_model_state(layer: Any) -> bool:
    """True for a cache class a model module defines for itself (DeepSeek V4.1's `LayerCache`:
    a window, compressed groups, index keys) that says it cannot trim: kept as it is, like
    recurrent state, never trimmed and snapshotted whole by checkpoints. Like mlx-lm's own
    state caches, it must replace its arrays on update, never write into them."""
    module = type(layer).__module__
    return (
        module.startswith("mlx_lm.models.")
        and module != mlx_cache.__name__
        and hasattr(layer, "offset")
        and not layer.is_trimmable()
    )


def copy_layer(layer: Any, drop: int = 0) -> Any:
    """An independent copy of a layer without its last `drop` tokens (the layer must be able
    to trim them: K/V layers copy only what they keep; others copy, then trim)."""
    if isinstance(layer, mlx_cache.CacheList):
        return mlx_cache.CacheList(*(copy_layer(c, drop) for c in layer.caches))
    if isinstance(layer, mlx_cache.ArraysCache):
        assert drop == 0, "recurrent state cannot trim"
        clone = mlx_cache.ArraysCache(len(layer.cache))
        clone.cache = list(layer.cache)  # recurrent arrays are replaced, never mutated
        return clone
    if is_model_state(layer):
        assert drop == 0, "a model's own state cannot trim"
        return copy.copy(layer)  # its arrays are replaced, never mutated
    # Our caches write into their buffers in place, so the copy needs arrays of its own.
    if always_trimmable(layer) and drop:  # state is (B, H, L, D) arrays: slice L
        keep = layer.offset - drop
        state = tree_map(lambda a: a[..., :keep, :] * 1, layer.state)
        return type(layer).from_state(state, layer.meta_state)
    state = tuple(tree_map(lambda a: mx.array(a) * 1, layer.state))
    clone = type(layer).from_state(state, layer.meta_state)
    if drop:
        clone.trim(drop)
    return clone


def arrays_of(layer: Any) -> list[mx.array]:
    """Every array the layer holds (a container's: its caches')."""
    if isinstance(layer, mlx_cache.CacheList):
        return [a for c in layer.caches for a in arrays_of(c)]
    if isinstance(layer, mlx_cache.ArraysCache):
        parts = layer.cache
    elif is_model_state(layer):
        parts = list(vars(layer).values())
    else:  # the raw buffers: `state` of a window cache would build a time-ordered copy
        parts = [getattr(layer, "keys", None), getattr(layer, "values", None)]
    return [a for _, a in tree_flatten(parts) if isinstance(a, mx.array)]


def layer_bytes(layer: Any) -> tuple[int, int]:
    """(allocated, used) bytes of the layer (a container's: its caches'): allocated counts
    unused slots too; a layer that does not tell its used bytes uses all it allocated."""
    if isinstance(layer, mlx_cache.CacheList):
        sizes = [layer_bytes(c) for c in layer.caches]
        return sum(a for a, _ in sizes), sum(u for _, u in sizes)
    return layer.nbytes, getattr(layer, "used_bytes", layer.nbytes)


def always_trimmable(layer: Any) -> bool:
    """Float or quantized KV layers go back any number of tokens by trimming."""
    return isinstance(layer, KVCache | QuantizedKVCache)


def leaves(layers: Sequence[Any]) -> list[Any]:
    """The per-layer caches with mlx-lm `CacheList` containers flattened out."""
    out = []
    for layer in layers:
        out.extend(leaves(layer.caches) if isinstance(layer, mlx_cache.CacheList) else [layer])
    return out


def is_unwritten(layer: Any) -> bool:
    """True for a K/V layer that holds no token: the model has not run yet, or never writes
    this layer's cache (Nemotron-NAS gives its linear replacements of attention one they
    ignore). It trims any count to nothing and joins no offset check."""
    return always_trimmable(layer) and layer.offset == 0


def layer_kind(layer: Any) -> str:
    """What a layer's cache keeps, in words (`mlxkv info`): "full attention", "sliding window
    4096", "chunked 8192", "recurrent state", or a container's parts joined by " + "."""
    if isinstance(layer, mlx_cache.CacheList):
        return " + ".join(layer_kind(c) for c in layer.caches)
    if isinstance(layer, mlx_cache.ArraysCache):
        return "recurrent state"
    if is_model_state(layer):
        return f"the model's own state ({type(layer).__name__})"
    if isinstance(layer, SlidingWindowCache):
        return f"sliding window {layer.window}"
    if isinstance(layer, ChunkedKVCache):
        return f"chunked {layer.chunk_size}"
    return "full attention (quantized)" if isinstance(layer, QuantizedKVCache) else "full attention"


def trim_reach(layer: Any) -> str:
    """How far a layer goes back by trimming, as `layer_can_trim` decides it: "any" (K/V),
    "window" (only to positions whose history it still holds) or "none" (recurrent state;
    checkpoints instead). A container reaches as far as its shortest part."""
    if isinstance(layer, mlx_cache.CacheList):
        reaches = {trim_reach(c) for c in layer.caches}
        return next(r for r in ("none", "window", "any") if r in reaches)
    if always_trimmable(layer):
        return "any"
    return "window" if hasattr(layer, "can_trim") else "none"


def layer_can_trim(layer: Any, num_tokens: int) -> bool:
    if num_tokens == 0 or is_unwritten(layer):
        return True
    if isinstance(layer, mlx_cache.CacheList):
        return all(layer_can_trim(c, num_tokens) for c in layer.caches)
    if hasattr(layer, "can_trim"):
        return layer.can_trim(num_tokens)
    return layer.is_trimmable() and num_tokens <= getattr(layer, "offset", 0)


def mark_layer(layer: Any) -> Any:
    """What `restore_layer` needs to undo a forward pass on this layer."""
    if isinstance(layer, mlx_cache.CacheList):
        return [mark_layer(c) for c in layer.caches]
    if isinstance(layer, mlx_cache.ArraysCache):
        return list(layer.cache)  # recurrent state arrays are replaced, never mutated
    if is_model_state(layer):
        return dict(vars(layer))
    return layer.offset


def restore_layer(layer: Any, mark: Any) -> None:
    if isinstance(layer, mlx_cache.CacheList):
        for c, m in zip(layer.caches, mark, strict=True):
            restore_layer(c, m)
    elif isinstance(layer, mlx_cache.ArraysCache):
        layer.cache = list(mark)
    elif is_model_state(layer):
        vars(layer).clear()
        vars(layer).update(mark)
    elif layer.offset > mark:
        layer.trim(layer.offset - mark)
