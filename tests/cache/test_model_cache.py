"""ModelCache management: layout per architecture, bytes, all-or-nothing trim, free."""

import mlx.core as mx
import pytest
from mlx_lm.models import cache as mlx_cache

from mlxkv.cache import KVCache, QuantizedKVCache, SlidingWindowCache, make_cache
from mlxkv.models.rope import rope_rotations
from tests.tolerances import assert_logits_close

LAYOUTS = {
    "llama": (KVCache, KVCache),
    "gemma3_text": (SlidingWindowCache, SlidingWindowCache, KVCache),
    "spark2_5": (SlidingWindowCache, SlidingWindowCache),
    "lfm2": (mlx_cache.ArraysCache, KVCache, mlx_cache.ArraysCache),
}


@pytest.mark.parametrize("arch", LAYOUTS)
def test_layout_follows_the_model(load_tiny, arch):
    model, _ = load_tiny(arch)
    cache = make_cache(model)
    assert tuple(type(layer) for layer in cache) == LAYOUTS[arch]
    windows = {layer.window for layer in cache if isinstance(layer, SlidingWindowCache)}
    assert windows <= {8}  # the factory's sliding_window


def test_kv_bits_quantizes_global_layers_only(load_tiny):
    model, _ = load_tiny("gemma3_text")
    cache = make_cache(model, kv_bits=4, kv_group_size=32)
    assert [type(layer) for layer in cache] == [
        SlidingWindowCache,
        SlidingWindowCache,
        QuantizedKVCache,
    ]
    with pytest.raises(ValueError, match="kv_bits=5"):
        make_cache(model, kv_bits=5)


def test_bytes_are_the_sum_over_layer_arrays(load_tiny):
    model, tokenizer = load_tiny("lfm2")
    cache = make_cache(model)
    cache.forward(model, tokenizer.encode("The quick brown fox jumps over the lazy dog"))
    arrays = []
    for layer in cache:
        if isinstance(layer, mlx_cache.ArraysCache):
            arrays += [a for a in layer.cache if a is not None]
        else:
            arrays += [layer.keys, layer.values]
    assert cache.nbytes == sum(a.nbytes for a in arrays)
    # In use: every recurrent array plus the attention layer's held tokens.
    attention = cache[1]
    per_token = attention.keys.nbytes * 2 // attention.keys.shape[2]
    recurrent = sum(a.nbytes for a in arrays) - attention.nbytes
    assert cache.used_bytes == recurrent + per_token * cache.num_tokens


def test_bytes_per_token_match_the_formula(load_tiny):
    model, tokenizer = load_tiny("llama")
    cache = make_cache(model)
    ids = tokenizer.encode("Paris is the capital of France")
    cache.forward(model, ids)
    args = model.args
    formula = 2 * args.num_hidden_layers * args.num_key_value_heads * args.head_dim * 4
    assert cache.used_bytes == formula * len(ids)


def test_trim_to_is_all_or_nothing(load_tiny):
    model, tokenizer = load_tiny("gemma3_text")
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    cache = make_cache(model)
    cache.forward(model, ids[:20])
    for token in ids[20:26]:
        cache.forward(model, [token])
    offsets = [layer.offset for layer in cache]
    assert not cache.can_trim_to(10)  # the window layers no longer hold position 3..9
    with pytest.raises(Exception, match="cannot go back"):
        cache.trim_to(10)
    assert [layer.offset for layer in cache] == offsets  # the global layer was not trimmed
    with pytest.raises(ValueError, match="holds 26"):
        cache.trim_to(27)
    assert cache.trim_to(25) == 1 and cache.num_tokens == 25


def test_free_drops_tokens_and_memory(load_tiny):
    model, tokenizer = load_tiny("llama")
    cache = make_cache(model)
    cache.forward(model, tokenizer.encode("hello, how are you?"))
    cache.free()
    assert cache.num_tokens == 0 and cache.nbytes == 0 and cache.tokens == []


def test_shrink_frees_slots_after_a_large_trim(load_tiny):
    model, _ = load_tiny("llama")
    cache = make_cache(model)
    cache.forward(model, list(range(600)))
    allocated = cache.nbytes
    cache.trim_to(100)
    assert cache.nbytes == allocated  # trim only moves the offset
    freed = cache.shrink()
    assert freed > 0 and cache.nbytes == allocated - freed
    assert all(layer.capacity_tokens == 256 for layer in cache)


def test_lazy_token_ids_are_read_back_on_demand(load_tiny):
    model, _ = load_tiny("llama")
    cache = make_cache(model)
    cache.forward(model, [5, 6])
    cache.forward(model, mx.array([7]))
    assert cache.num_tokens == 3
    assert cache.tokens == [5, 6, 7]


def test_ids_fed_as_a_list_after_lazy_ones_keep_their_order(load_tiny):
    """Speculative decoding feeds a verify pass as a list after plain decoding's lazy ids."""
    model, _ = load_tiny("llama")
    cache = make_cache(model)
    cache.forward(model, [5, 6])
    cache.forward(model, mx.array([7], dtype=mx.uint32))
    cache.forward(model, [8, 9])
    cache.forward(model, mx.array([10], dtype=mx.uint32))
    assert cache.num_tokens == 6
    assert cache.tokens == [5, 6, 7, 8, 9, 10]
    _, keep = cache.forward_tentative(model, [11, 12, 13])
    keep(1)
    assert cache.tokens == [5, 6, 7, 8, 9, 10, 11]


@pytest.mark.parametrize("arch", ["lfm2", "mamba"])
def test_going_back_to_zero_starts_over_where_layers_cannot_trim(load_tiny, arch):
    model, _ = load_tiny(arch)
    cache = make_cache(model)
    cache.forward(model, [5, 6, 7])
    assert not cache.can_trim_to(0) and cache.nearest_restorable(1) == 0
    copy = cache.copy_prefix(0)
    assert cache.rewind_to(0) == 3
    for empty in (cache, copy):
        assert empty.num_tokens == 0 and empty.tokens == []
        assert_logits_close(empty.forward(model, [8])[0], model(mx.array([[8]]))[0])


def test_empty_forward_is_refused(load_tiny):
    model, _ = load_tiny("llama")
    with pytest.raises(ValueError, match="at least one token"):
        make_cache(model).forward(model, [])


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "lfm2"])
def test_copy_is_independent_and_continues_identically(load_tiny, arch):
    model, tokenizer = load_tiny(arch)
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog, 42 times. " * 4)
    assert len(ids) >= 30
    cache = make_cache(model)
    cache.forward(model, ids[:15])
    for token in ids[15:20]:
        cache.forward(model, [token])
    clone = cache.copy()
    want = cache.forward(model, ids[20:24])
    cache.forward(model, ids[24:30])  # the original moves on; the clone must not see it
    got = clone.forward(model, ids[20:24])
    assert clone.tokens == ids[:24] and cache.tokens == ids[:30]
    assert_logits_close(got, want)


def test_full_cache_refuses_the_batch_and_changes_nothing(load_tiny):
    from mlxkv import CacheFullError

    model, _ = load_tiny("llama")
    cache = make_cache(model)
    cache.capacity_tokens = 10
    cache.forward(model, list(range(8)))
    with pytest.raises(CacheFullError, match="at most 10 tokens") as raised:
        cache.forward(model, [1, 2, 3])
    assert raised.value.capacity_tokens == 10
    assert cache.num_tokens == 8 and {layer.offset for layer in cache} == {8}
    cache.forward(model, [1, 2])  # exactly full is fine


def test_shifted_marks_only_caches_holding_k_v_a_shift_approximates(load_tiny):
    """An in-place shift leaves the K/V past its `keep` approximate, and only those: trimmed
    back to the kept tokens, or freed, the cache equals a prefill of its tokens again and is
    no longer `shifted` (the invariant every test's Runner checks was skipped for good after
    one shift); a copy of the shifted part stays `shifted`."""
    model, _ = load_tiny("llama")
    rotations = rope_rotations(model)
    ids = [(7 * i + 3) % 500 for i in range(40)]
    cache = make_cache(model)
    cache.forward(model, ids[:30])
    cache.shift(4, 11, rotations)
    assert cache.shifted
    assert cache.copy_prefix(10).shifted and not cache.copy_prefix(4).shifted
    cache.trim_to(6)
    assert cache.shifted  # tokens 4 and 5 are the shifted ones
    cache.trim_to(4)
    assert not cache.shifted
    got = cache.forward(model, ids[30:33])[0]
    assert_logits_close(got, model(mx.array(ids[:4] + ids[30:33])[None])[0, -3:])
    cache.shift(2, 3, rotations)
    cache.free()
    assert not cache.shifted
