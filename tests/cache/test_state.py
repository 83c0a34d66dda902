"""state / meta_state round trips: a rebuilt cache continues exactly like the original."""

import mlx.core as mx
import pytest

from mlxkv.cache import ChunkedKVCache, KVCache, QuantizedKVCache, SlidingWindowCache
from tests.factories import make_kv, positions_of

MAKERS = {
    "kv": lambda: KVCache(step=4),
    "quantized": lambda: QuantizedKVCache(group_size=32, bits=8, step=4),
    "window": lambda: SlidingWindowCache(5, step=2),
    "window_with_sinks": lambda: SlidingWindowCache(5, keep=2, step=2),
    "chunked": lambda: ChunkedKVCache(4, step=2),
}


def _feed(cache, positions):
    keys, values = make_kv(positions, head_dim=32)
    return cache.update_and_fetch(keys, values)


def _first(fetched):
    """Keys as floats, whether the cache stores them quantized or not."""
    keys = fetched[0]
    if isinstance(keys, tuple):
        return mx.dequantize(*keys, group_size=32, bits=8)
    return keys


@pytest.mark.parametrize("kind", MAKERS)
def test_state_round_trip_continues_identically(kind):
    original = MAKERS[kind]()
    _feed(original, range(0, 7))
    for p in range(7, 10):  # decode steps: the window's ring wraps
        _feed(original, [p])
    rebuilt = type(original).from_state(original.state, original.meta_state)
    assert rebuilt.offset == original.offset == 10
    assert rebuilt.used_bytes == original.used_bytes
    for chunk in ([10], [11, 12, 13], [14]):
        want = _first(_feed(original, chunk))
        got = _first(_feed(rebuilt, chunk))
        # Slot order may differ once a ring wraps; the held tokens may not.
        assert sorted(positions_of(got)) == sorted(positions_of(want))
        assert positions_of(_first(rebuilt.state)) == positions_of(_first(original.state))


def test_empty_state_round_trip():
    cache = KVCache.from_state(KVCache().state, KVCache().meta_state)
    assert cache.empty() and cache.offset == 0


@pytest.mark.parametrize("kind", MAKERS)
def test_a_state_from_another_class_is_a_clear_error(kind):
    from mlxkv import CacheStateError

    cache = MAKERS[kind]()
    _feed(cache, range(3))
    other = KVCache if kind != "kv" else SlidingWindowCache
    with pytest.raises(CacheStateError, match="were not saved by"):
        other.from_state(cache.state, ("1", "2", "3", "4", "5", "6"))


def test_a_chunked_model_cache_saves_and_loads_exactly(load_tiny):
    """Llama 4's chunked layers go through the disk tier's arrays and back, and continue as
    the original does."""
    from mlxkv.cache import make_cache
    from mlxkv.cache.serialize import arrays_to_cache, cache_to_arrays
    from tests.tolerances import assert_logits_close

    model, _ = load_tiny("llama4")
    ids = list(range(3, 30))
    original = make_cache(model)
    original.forward(model, ids[:20])
    original.forward(model, ids[20:23])  # the front has moved: chunks of 8
    assert original[0].start_position > 0
    arrays, layout = cache_to_arrays(original)
    loaded = arrays_to_cache(arrays, layout, original.tokens, make_cache(model))
    assert_logits_close(loaded.forward(model, ids[23:])[0], original.forward(model, ids[23:])[0])


@pytest.mark.parametrize("lie", ["window", "arrays"])
def test_a_layout_is_rebuilt_only_as_the_models_own_layers(load_tiny, lie):
    """A saved layout that names another window than the model's sliding layers have, or
    another count of recurrent arrays, is refused (a file's signature is its header's word,
    not its layout's): rebuilt, the first attended over the wrong tokens."""
    from mlxkv.cache import make_cache
    from mlxkv.cache.serialize import arrays_to_cache, cache_to_arrays
    from mlxkv.errors import CacheStateError

    arch, kind = ("gemma3_text", "SlidingWindowCache") if lie == "window" else ("lfm2", "")
    model, _ = load_tiny(arch)
    original = make_cache(model)
    original.forward(model, list(range(3, 30)))
    arrays, layout = cache_to_arrays(original)
    if lie == "window":
        entry = next(e for e in layout["layers"] if e["kind"] == kind)
        entry["meta"][1] = str(2 * int(entry["meta"][1]))
    else:
        entry = next(e for e in layout["layers"] if "arrays" in e)
        entry["size"] += 1
    with pytest.raises(CacheStateError, match="the model's"):
        arrays_to_cache(arrays, layout, original.tokens, make_cache(model))
