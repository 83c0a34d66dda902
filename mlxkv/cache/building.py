"""Building an empty ModelCache for any mlx-lm model: the model's own `make_cache()` decides
the layout, and each of mlx-lm's layer caches becomes mlxkv's own, stays as it is, or is
refused by name (`MLX_LM_CACHE_CLASSES`).
"""

from __future__ import annotations

from typing import Any

import mlx.nn as nn
from mlx_lm.models import cache as mlx_cache

from mlxkv.cache.layer_ops import is_model_state
from mlxkv.cache.layers.chunked import ChunkedKVCache
from mlxkv.cache.layers.kv import KVCache
from mlxkv.cache.layers.quantized import QuantizedKVCache
from mlxkv.cache.layers.window import SlidingWindowCache
from mlxkv.cache.model_cache import ModelCache
from mlxkv.config import check_kv_quantization
from mlxkv.errors import NotSupportedError

# What mlxkv does with each of mlx-lm's cache classes (`mlx_lm.models.cache`): converted to
# its own, kept as mlx-lm's (recurrent state, containers), or refused by `make_cache`. A class
# a model module defines for itself is kept too when it cannot trim (`is_model_state`). A new
# mlx-lm class fails tests/cache/test_mlx_lm_contract.py until it is listed here.
MLX_LM_CACHE_CLASSES = {
    "KVCache": "converted",
    "QuantizedKVCache": "converted",
    "RotatingKVCache": "converted",
    "CacheList": "kept",
    "ArraysCache": "kept",
    "ChunkedKVCache": "converted",
    "ConcatenateKVCache": "converted",
    "BatchKVCache": "refused",  # batching's, not a model's
    "BatchRotatingKVCache": "refused",
}


def make_cache(
    model: nn.Module, *, kv_bits: int | None = None, kv_group_size: int = 64
) -> ModelCache:
    """Builds an empty ModelCache for any mlx-lm model.

    The model's own `make_cache()` decides the layout (which layers are global, which use a
    sliding window, which keep recurrent state); mlxkv's classes replace mlx-lm's KV classes.

    Args:
        model: a model from `mlx_lm.models` (or anything with `layers` and mlx-lm's call).
        kv_bits: quantize global-attention K/V to 8 or 4 bits; None keeps the model's dtype.
            Sliding-window layers stay unquantized: their memory is already bounded.
        kv_group_size: head-dimension elements per quantization scale (32, 64 or 128).

    Raises:
        ValueError: for kv_bits or kv_group_size that `mx.quantize` does not support.
        NotSupportedError: a layer cache class mlxkv does not know (`MLX_LM_CACHE_CLASSES`).
    """
    if kv_bits is not None:
        check_kv_quantization(kv_bits, kv_group_size)

    def convert(layer: Any) -> Any:
        if type(layer) in (
            mlx_cache.KVCache,
            mlx_cache.QuantizedKVCache,
            mlx_cache.ConcatenateKVCache,
        ):
            return KVCache() if kv_bits is None else QuantizedKVCache(kv_group_size, kv_bits)
        if type(layer) is mlx_cache.RotatingKVCache:
            return SlidingWindowCache(layer.max_size, keep=layer.keep)
        if type(layer) is mlx_cache.ChunkedKVCache:
            return ChunkedKVCache(layer.chunk_size)
        if type(layer) is mlx_cache.CacheList:
            return mlx_cache.CacheList(*(convert(c) for c in layer.caches))
        if isinstance(layer, mlx_cache.ArraysCache) or is_model_state(layer):
            return layer  # recurrent state, or a model's own: kept, restored by checkpoints
        raise NotSupportedError(
            f"{type(model).__module__.rsplit('.', 1)[-1]}: this model's cache uses "
            f"{type(layer).__name__}, which mlxkv does not handle yet; use a model of another "
            "architecture"
        )

    def make_layers() -> list[Any]:
        if hasattr(model, "make_cache"):
            template = model.make_cache()
        else:
            template = [mlx_cache.KVCache() for _ in model.layers]
        return [convert(layer) for layer in template]

    return ModelCache(make_layers(), make_layers)
