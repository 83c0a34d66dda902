"""QuantizedKVCache: bytes per element and reconstruction error, scales and biases included."""

import mlx.core as mx
import pytest

from mlxkv.cache import KVCache, QuantizedKVCache

# (bits, bytes per K/V element allowed, max |error| / max |x| allowed)
BUDGETS = [(8, 1.13, 0.01), (4, 0.63, 0.1)]


@pytest.mark.parametrize(("bits", "max_bytes", "max_rel_err"), BUDGETS)
def test_bytes_per_element_and_error_within_budget(bits, max_bytes, max_rel_err):
    mx.random.seed(1)
    keys = mx.random.normal((1, 4, 256, 128))
    values = mx.random.normal((1, 4, 256, 128))
    cache = QuantizedKVCache(group_size=64, bits=bits)
    cache.update_and_fetch(keys, values)
    elements = keys.size + values.size
    assert cache.capacity_tokens == 256  # exactly one step: allocated == used
    assert cache.nbytes / elements <= max_bytes
    assert cache.nbytes == sum(a.nbytes for a in cache.keys + cache.values)
    got_k, got_v = cache.dequantized()
    for got, want in ((got_k, keys), (got_v, values)):
        rel = (mx.abs(got - want).max() / mx.abs(want).max()).item()
        assert rel < max_rel_err, f"{bits}-bit relative error {rel:.3g}"


def test_from_float_cache_holds_same_tokens():
    keys, values = mx.random.normal((1, 2, 10, 64)), mx.random.normal((1, 2, 10, 64))
    float_cache = KVCache()
    float_cache.update_and_fetch(keys, values)
    quantized = float_cache.to_quantized(group_size=64, bits=8)
    assert quantized.offset == 10
    got_k, _ = quantized.dequantized()
    assert mx.abs(got_k - keys).max().item() < 0.05


@pytest.mark.parametrize(("bits", "group_size"), [(3, 64), (8, 16)])
def test_unsupported_settings_name_the_allowed_values(bits, group_size):
    with pytest.raises(ValueError, match="use one of"):
        QuantizedKVCache(group_size=group_size, bits=bits)


def test_head_dim_not_divisible_by_group_is_a_clear_error():
    cache = QuantizedKVCache(group_size=64, bits=8)
    with pytest.raises(ValueError, match="head dimension 16 is not a multiple"):
        cache.update_and_fetch(mx.zeros((1, 1, 2, 16)), mx.zeros((1, 1, 2, 16)))


def test_keys_reassigned_as_a_list_keep_updating_as_before():
    """mlx-lm's pipeline-parallel models, on every rank but the last, reassign the last
    layer's keys to `mx.depends(cache.keys, h)`: a list for a quantized cache. The next update
    (a sharded `--kv-bits` run's second forward pass) raised a TypeError on it."""
    mx.random.seed(2)
    chunks = [(mx.random.normal((1, 2, n, 64)), mx.random.normal((1, 2, n, 64))) for n in (5, 3)]
    reassigned, plain = QuantizedKVCache(group_size=64), QuantizedKVCache(group_size=64)
    for keys, values in chunks:
        plain.update_and_fetch(keys, values)
        reassigned.update_and_fetch(keys, values)
        reassigned.keys = mx.depends(reassigned.keys, keys)
    for got, want in zip(reassigned.dequantized(), plain.dequantized(), strict=True):
        assert mx.array_equal(got, want)
