"""The KV cache layer: per-layer caches that speak mlx-lm's model-facing protocol.

Imports `platform` (and `config`, `errors`) only: everything else builds on this layer, never the
reverse.
"""

from mlxkv.cache.building import make_cache
from mlxkv.cache.layers.base import LayerCache
from mlxkv.cache.layers.chunked import ChunkedKVCache
from mlxkv.cache.layers.kv import KVCache
from mlxkv.cache.layers.quantized import QuantizedKVCache
from mlxkv.cache.layers.window import SlidingWindowCache
from mlxkv.cache.model_cache import ModelCache

__all__ = [
    "ChunkedKVCache",
    "KVCache",
    "LayerCache",
    "ModelCache",
    "QuantizedKVCache",
    "SlidingWindowCache",
    "make_cache",
]
