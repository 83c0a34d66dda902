"""A ModelCache as named arrays plus a JSON layout, and back: what the disk tier writes.

Owns: the mapping between per-layer caches (mlxkv's K/V classes, mlx-lm's recurrent
`ArraysCache` kinds, `CacheList` containers) and flat `{name: array}` dicts, for the layers
and for each checkpoint; `layout_signature`, which says whether two caches have the same
shape of layers. Does not own files, checksums or the index (see `store`).

Terms:
  layout     per layer: its class name, its `meta_state` and the names of its arrays; with
             "exact_tokens" while the cache is `shifted` (`ModelCache.exact_tokens`), so a
             restore stays marked approximate (a layout without it, as every file written
             before it was saved, restores unmarked: exact);
  signature  the layout without anything that depends on the tokens held (offsets, arrays).
"""

from __future__ import annotations

import json
import re
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import cache as mlx_cache

from mlxkv.cache.layers.chunked import ChunkedKVCache
from mlxkv.cache.layers.kv import KVCache
from mlxkv.cache.layers.quantized import QuantizedKVCache
from mlxkv.cache.layers.window import SlidingWindowCache
from mlxkv.cache.model_cache import ModelCache
from mlxkv.errors import CacheStateError, NotSupportedError

_STATEFUL = {
    cls.__name__: cls for cls in (KVCache, QuantizedKVCache, SlidingWindowCache, ChunkedKVCache)
}


_LAYER_NAME = re.compile(r"(?:l|c\d+)\.(\d+)(?:[./]|$)")
_SNAPSHOT_PREFIX = re.compile(r"^c\d+\.")  # a checkpoint's snapshot of layer i: c<at>.<i>...
# (shape, dtype) of each array `cache_to_arrays` names for a layer's state
ArrayShapes = dict[str, tuple[tuple[int, ...], mx.Dtype]]


def cache_to_arrays(
    cache: ModelCache, disk_snapshots: dict[int, list[Any]] | None = None
) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """The arrays (lazy slices of the cache's buffers) and the layout that rebuild `cache`,
    with `disk_snapshots` (`ModelCache.take_disk_snapshots`) among its checkpoints.

    Raises:
        NotSupportedError: a layer of a class this module cannot save.
    """
    arrays: dict[str, mx.array] = {}
    layout = {
        "layers": [_layer_layout(layer, f"l.{i}", arrays) for i, layer in enumerate(cache)],
        "checkpoints": [
            {
                "at": at,
                "layers": [
                    None if saved is None else _layer_layout(saved, f"c{at}.{i}", arrays)
                    for i, saved in enumerate(snapshot)
                ],
            }
            for at, snapshot in sorted({**(disk_snapshots or {}), **cache.checkpoints}.items())
        ],
    }
    if cache.exact_tokens is not None:
        layout["exact_tokens"] = cache.exact_tokens
    return arrays, layout


def array_shapes(cache: ModelCache) -> ArrayShapes:
    """The shape and dtype of each array of `cache` (the model's own, holding a token) as
    `cache_to_arrays` names a layer's state: what a restore's arrays are held to
    (`check_shapes`)."""
    arrays, _ = cache_to_arrays(cache)
    return {name: (tuple(a.shape), a.dtype) for name, a in arrays.items() if name[:2] == "l."}


def check_shapes(arrays: dict[str, mx.array], shapes: ArrayShapes) -> None:
    """Raises CacheStateError unless each of a restore's `arrays` (a checkpoint's snapshot as
    the layer it snapshots) has the model's dtype, rank and shape (`array_shapes`), but for
    the token axis of a 4-D array (K/V, windows, chunks). Files whose K/V had another head
    count or head size passed every other check and failed in the model on every request
    that restored them."""
    for name, array in arrays.items():
        own = shapes.get(_SNAPSHOT_PREFIX.sub("l.", name, count=1))
        if own is None:  # an array the model's first token left unset
            continue
        shape, dtype = own
        kept = [k for k in range(len(shape)) if not (len(shape) == 4 and k == 2)]
        if (
            array.dtype != dtype
            or array.ndim != len(shape)
            or any(array.shape[k] != shape[k] for k in kept)
        ):
            raise CacheStateError(
                f"{name} is {array.dtype} {tuple(array.shape)}; the model's is {dtype} {shape}"
            )


def layer_of(name: str) -> int:
    """The model layer an array named by `cache_to_arrays` belongs to (a layer's state
    `l.<i>...`, its snapshot at a checkpoint `c<at>.<i>...`, with whatever follows), -1 for a
    name of neither form: which layer's section of a disk block it is checked with."""
    match = _LAYER_NAME.match(name)
    return int(match.group(1)) if match else -1


def arrays_to_cache(
    arrays: dict[str, mx.array], layout: dict[str, Any], tokens: list[int], cache: ModelCache
) -> ModelCache:
    """Fills the empty `cache` (from the model's `make_cache`) with what `cache_to_arrays` saved.

    Raises:
        CacheStateError: the layout or arrays do not rebuild a cache holding `tokens`.
    """
    try:
        layers = [_layer_from(entry, arrays) for entry in layout["layers"]]
        checkpoints = {
            int(point["at"]): [
                None if entry is None else _layer_from(entry, arrays) for entry in point["layers"]
            ]
            for point in layout["checkpoints"]
        }
        if len(layers) != len(cache):
            raise ValueError(f"{len(layers)} layers saved; the model has {len(cache)}")
        for saved in [layers, *checkpoints.values()]:
            for layer, empty in zip(saved, cache, strict=True):
                _check_kind(layer, empty)
        exact = layout.get("exact_tokens")
        cache.adopt(layers, tokens, checkpoints, exact_tokens=None if exact is None else int(exact))
    except (KeyError, TypeError, ValueError, IndexError) as error:
        raise CacheStateError(f"saved cache does not rebuild: {error}") from error
    return cache


def layout_signature(cache: ModelCache) -> str:
    """The layer classes and their token-independent settings, as a string: files written for
    one signature are only ever loaded into caches of the same one."""
    return json.dumps([_signature(layer) for layer in cache.layers])


def _signature(layer: Any) -> Any:
    if isinstance(layer, mlx_cache.CacheList):
        return [_signature(c) for c in layer.caches]
    settings = {
        name: getattr(layer, name)
        for name in ("window", "keep", "chunk_size", "group_size", "bits")
        if isinstance(getattr(layer, name, None), int)
    }
    return [type(layer).__name__, settings]


def _layer_layout(layer: Any, prefix: str, arrays: dict[str, mx.array]) -> dict[str, Any]:
    kind = type(layer).__name__
    if isinstance(layer, mlx_cache.CacheList):
        children = [_layer_layout(c, f"{prefix}.{j}", arrays) for j, c in enumerate(layer.caches)]
        return {"kind": "CacheList", "children": children}
    if isinstance(layer, mlx_cache.ArraysCache):
        present = [j for j, a in enumerate(layer.cache) if a is not None]
        names = [f"{prefix}.{j}" for j in present]
        arrays.update({name: layer.cache[j] for name, j in zip(names, present, strict=True)})
        return {"kind": kind, "size": len(layer.cache), "present": present, "arrays": names}
    if kind not in _STATEFUL:
        raise NotSupportedError(f"cannot save a layer cache of type {kind}")
    # tree paths ("0", "1.2") are kept so the nesting of `state` comes back
    state = tree_flatten(layer.state)
    arrays.update({f"{prefix}/{path}": array for path, array in state})
    return {
        "kind": kind,
        "meta": list(layer.meta_state),
        "prefix": prefix,
        "paths": [path for path, _ in state],
    }


def _check_kind(layer: Any, empty: Any) -> None:
    """Raises ValueError unless a layer rebuilt from a layout (None: a snapshot not taken) is
    of the class and settings of the model's own (`empty`, from `make_cache`): a file's
    signature is its header's word, and its layout could still name another class, window or
    quantization. Its buffer's growth step becomes the model's: how a buffer grows is this
    process's choice, and a saved step of 2**31 asked MLX for a buffer it died allocating."""
    if layer is None:
        return
    if type(layer) is not type(empty):
        raise ValueError(f"a {type(layer).__name__} where the model has a {type(empty).__name__}")
    if isinstance(layer, mlx_cache.CacheList):
        for child, empty_child in zip(layer.caches, empty.caches, strict=True):
            _check_kind(child, empty_child)
    elif isinstance(layer, mlx_cache.ArraysCache):
        if len(layer.cache) != len(empty.cache):
            raise ValueError(
                f"{len(layer.cache)} arrays where the model's layer has {len(empty.cache)}"
            )
    elif _signature(layer) != _signature(empty):
        raise ValueError(f"a {type(layer).__name__} of {_signature(layer)[1]}, not the model's")
    else:
        layer.step = empty.step


def _layer_from(entry: dict[str, Any], arrays: dict[str, mx.array]) -> Any:
    kind = entry["kind"]
    if kind == "CacheList":
        return mlx_cache.CacheList(*(_layer_from(c, arrays) for c in entry["children"]))
    if kind in _STATEFUL:
        prefix = entry["prefix"]
        state = tree_unflatten([(path, arrays[f"{prefix}/{path}"]) for path in entry["paths"]])
        return _STATEFUL[kind].from_state(state or (), tuple(entry["meta"]))
    cls = getattr(mlx_cache, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, mlx_cache.ArraysCache)):
        raise CacheStateError(f"unknown layer cache type {kind!r}")
    layer = cls.__new__(cls)
    layer.cache = [None] * int(entry["size"])
    layer.left_padding = layer.lengths = None
    for j, name in zip(entry["present"], entry["arrays"], strict=True):
        layer.cache[j] = arrays[name]
    return layer
