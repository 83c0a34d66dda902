"""Logits through mlxkv's caches equal logits of the model run with no cache at all."""

import mlx.core as mx
import pytest

from mlxkv.cache import make_cache
from mlxkv.errors import NotSupportedError
from mlxkv.testing.factory import ARCHITECTURES
from tests.tolerances import assert_logits_close

TRIMMABLE = ("llama", "qwen3", "gemma3_text", "spark2_5")


def _prompt(tokenizer, text: str, repeat: int = 2) -> list[int]:
    ids = tokenizer.encode(text)
    return (ids * repeat)[:40]


def _no_cache_logits(model, ids: list[int]) -> mx.array:
    return model(mx.array(ids)[None])[0]


_assert_close = assert_logits_close


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_chunked_prefill_then_decode_equals_no_cache(load_tiny, arch):
    model, tokenizer = load_tiny(arch)
    ids = _prompt(tokenizer, "The quick brown fox jumps over the lazy dog, 42 times.")
    want = _no_cache_logits(model, ids)
    cache = make_cache(model)
    chunks, start = [], 0
    for size in (5, 1, 9, 2, 13):  # window is 8: chunks cross it, decode steps wrap the ring
        chunks.append(cache.forward(model, ids[start : start + size])[0])
        start += size
    for token in ids[start:]:
        chunks.append(cache.forward(model, [token])[0])
    _assert_close(mx.concatenate(chunks), want)
    assert cache.num_tokens == len(ids)
    assert cache.tokens == ids


@pytest.mark.parametrize("arch", TRIMMABLE)
@pytest.mark.parametrize("trim", [1, 3, 6])
@pytest.mark.parametrize("decode_steps", [0, 4])
def test_trim_then_new_tokens_equals_cache_that_never_saw_the_old(
    load_tiny, arch, trim, decode_steps
):
    model, tokenizer = load_tiny(arch)
    first = _prompt(tokenizer, "Paris is the capital of France and Rome of Italy.")
    other = _prompt(tokenizer, "def f(x): return x + 1", repeat=1)[:5]
    cache = make_cache(model)
    cache.forward(model, first[:20])
    for token in first[20 : 20 + decode_steps]:  # decode steps wrap the window's ring
        cache.forward(model, [token])
    held = 20 + decode_steps
    # Window of 8: after the ring wraps it holds positions held-8..held-1, and a token at
    # position p needs p-7..p-1, so only one step back is exact.
    can_go_back = arch in ("llama", "qwen3") or decode_steps == 0 or trim <= 1
    assert cache.can_trim_to(held - trim) == can_go_back
    if not can_go_back:
        return
    assert cache.trim_to(held - trim) == trim
    got = cache.forward(model, other)[0]
    want = _no_cache_logits(model, first[: held - trim] + other)[-len(other) :]
    _assert_close(got, want)


@pytest.mark.parametrize("arch", ["lfm2", "mamba"])
def test_recurrent_layers_refuse_trim_and_keep_state(load_tiny, arch):
    model, tokenizer = load_tiny(arch)
    ids = _prompt(tokenizer, "hello, how are you? I am fine, thank you!")
    cache = make_cache(model)
    cache.forward(model, ids[:10])
    assert not cache.can_trim_to(9)
    with pytest.raises(NotSupportedError, match="ArraysCache"):
        cache.trim_to(9)
    assert cache.num_tokens == 10
    got = cache.forward(model, ids[10:12])[0]
    _assert_close(got, _no_cache_logits(model, ids[:12])[10:])


def test_sliding_window_refuses_trim_past_what_it_holds(load_tiny):
    model, tokenizer = load_tiny("spark2_5")  # window of 8 tokens
    ids = _prompt(tokenizer, "The quick brown fox jumps over the lazy dog.")
    cache = make_cache(model)
    cache.forward(model, ids[:16])
    for token in ids[16:20]:
        cache.forward(model, [token])
    assert not cache.can_trim_to(10)
    with pytest.raises(NotSupportedError, match="SlidingWindowCache"):
        cache.trim_to(10)
    assert cache.tokens == ids[:20]
    assert cache.can_trim_to(0)  # going back to empty is always possible


def test_quantized_kv_stays_close_to_float(load_tiny, model_root):
    from mlx_lm import load

    from mlxkv.testing.factory import build_model

    path = build_model("llama", f"{model_root}/llama-hd32", config_overrides={"head_dim": 32})
    model, tokenizer = load(str(path))
    ids = _prompt(tokenizer, "The quick brown fox jumps over the lazy dog, 42 times.")
    want = _no_cache_logits(model, ids)
    scale = mx.abs(want).max().item()
    # Measured on the factory llama (logits up to about 9): 8-bit 3.3% of the scale with every
    # top-1 token kept; 4-bit 57% with 70% kept. The bounds leave room for other machines.
    for bits, rtol, agreement in ((8, 0.05, 0.95), (4, 0.75, 0.5)):
        cache = make_cache(model, kv_bits=bits, kv_group_size=32)
        got = mx.concatenate([cache.forward(model, ids[:20])[0], cache.forward(model, ids[20:])[0]])
        diff = mx.abs(got - want).max().item()
        assert diff < rtol * scale, f"{bits}-bit: max |diff| {diff:.3g} >= {rtol} x {scale:.3g}"
        same = (mx.argmax(got, axis=-1) == mx.argmax(want, axis=-1)).mean().item()
        assert same >= agreement, f"{bits}-bit: top-1 agrees at {same:.0%} of positions"
        assert type(cache[0]).__name__ == "QuantizedKVCache"


def test_forward_that_raises_leaves_cache_unchanged(load_tiny):
    model, tokenizer = load_tiny("gemma3_text")
    ids = _prompt(tokenizer, "Berlin is the capital of Germany.")
    cache = make_cache(model)
    cache.forward(model, ids[:12])

    calls = {"n": 0}
    real_call = type(cache[1]).update_and_fetch

    def failing(self, keys, values):
        calls["n"] += 1
        if calls["n"] == 2:  # the first layer has already stored the new tokens
            raise KeyboardInterrupt
        return real_call(self, keys, values)

    type(cache[1]).update_and_fetch = failing
    try:
        with pytest.raises(KeyboardInterrupt):
            cache.forward(model, ids[12:20])
    finally:
        type(cache[1]).update_and_fetch = real_call
    assert cache.num_tokens == 12
    assert {layer.offset for layer in cache} == {12}
    got = cache.forward(model, ids[12:20])[0]
    _assert_close(got, _no_cache_logits(model, ids[:20])[12:])
