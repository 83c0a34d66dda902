"""The parts of mlx-lm mlxkv relies on beyond its public calls, checked against the installed
version: every cache class a model's `make_cache()` may return is one mlxkv converts, keeps
or refuses by name (never passed through unknown), and Llama3RoPE still keeps the
frequencies mlxkv's context shift reads."""

from __future__ import annotations

import inspect

import mlx.core as mx
import mlx.nn as nn
import mlx_lm.models.cache as mlx_cache
import pytest
from mlx_lm.models.rope_utils import Llama3RoPE

from mlxkv import NotSupportedError, make_cache
from mlxkv.cache.building import MLX_LM_CACHE_CLASSES


def test_every_mlx_lm_cache_class_is_known():
    classes = {
        name
        for name, cls in inspect.getmembers(mlx_cache, inspect.isclass)
        if issubclass(cls, mlx_cache._BaseCache) and cls is not mlx_cache._BaseCache
    }
    assert classes == set(MLX_LM_CACHE_CLASSES), (
        "mlx-lm's cache classes changed: list each new one in MLX_LM_CACHE_CLASSES with what "
        "make_cache does with it"
    )


def test_an_unknown_cache_class_is_refused_by_name():
    class Model:
        layers = [object()]

        def make_cache(self):
            return [mlx_cache.BatchKVCache([0])]

    with pytest.raises(NotSupportedError, match="BatchKVCache"):
        make_cache(Model())


_LLAMA3_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
_ROPES = {
    "rope": nn.RoPE(8, base=10000.0),
    "llama3": Llama3RoPE(8, max_position_embeddings=128, scaling_config=_LLAMA3_SCALING),
}


@pytest.mark.parametrize("rope", list(_ROPES.values()), ids=list(_ROPES))
def test_a_rope_turns_rotated_keys_further_by_its_own_call(rope):
    """A context shift re-rotates cached keys with the RoPE's public call, one position per
    token (`engine.context`): keys rotated at positions 3.. and then by 4 are those at 7.."""
    keys = mx.random.normal((1, 2, 5, 8), key=mx.random.key(0))
    turned = rope(rope(keys, offset=3)[..., None, :], offset=4).squeeze(-2)
    assert mx.allclose(turned, rope(keys, offset=7), atol=1e-5)
