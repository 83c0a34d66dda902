"""The KV cache layer: per-layer caches that speak mlx-lm's model-facing protocol.

Imports `platform` (and `config`, `errors`) only: everything else builds on this layer, never the
reverse.
"""

from mlxkv.cache.base import LayerCache
from mlxkv.cache.building import make_cache
from mlxkv.cache.chunked import ChunkedKVCache
from mlxkv.cache.kv import KVCache
from mlxkv.cache.model_cache import ModelCache
from mlxkv.cache.quantized import QuantizedKVCache
from mlxkv.cache.window import SlidingWindowCache

__all__ = [
    "ChunkedKVCache",
    "KVCache",
    "LayerCache",
    "ModelCache",
    "QuantizedKVCache",
    "SlidingWindowCache",
    "make_cache",
]
