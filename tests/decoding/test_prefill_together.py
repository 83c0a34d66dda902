"""Prompts prefilled together in one batched pass against each prefilled alone: the same
last-token logits (within the batched kernels' rounding), and every cache afterwards holds
its earlier tokens and its prompt, with K/V that continue exactly as the alone cache's do.
A failed pass leaves every cache as it was."""

from __future__ import annotations

import pytest

from mlxkv.cache.batched import can_batch
from mlxkv.cache.building import make_cache
from mlxkv.decoding.prefill.batched import prefill_together
from mlxkv.decoding.prefill.chunks import PrefillPlan, fill, prefill
from tests.tolerances import assert_logits_close

PLAN = PrefillPlan(512)
# (tokens the cache holds already, the prompt fed after them): empty and filled caches,
# prompts of one token and of several, rows of every length against each other.
ROWS = [
    ([], [5, 9, 13, 2, 77, 31]),
    ([3, 4, 5, 6, 7, 8], [1]),
    (list(range(20, 45)), [7, 8, 9]),
    ([], [42]),
    ([11, 12], list(range(100, 119))),
]
NEXT = [61]  # fed after the prompt, to compare what the caches go on to compute


def _cache_holding(model, tokens):
    cache = make_cache(model)
    if tokens:
        fill(model, cache, tokens, PLAN)
    return cache


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
def test_rows_prefilled_together_match_each_alone(loaded_tiny, arch):
    model = loaded_tiny(arch).model
    caches = [_cache_holding(model, held) for held, _ in ROWS]
    assert all(can_batch(cache) for cache in caches)
    got = prefill_together(model, caches, [prompt for _, prompt in ROWS])
    for (held, prompt), cache, logits in zip(ROWS, caches, got, strict=True):
        alone = _cache_holding(model, held)
        assert_logits_close(logits, prefill(model, alone, prompt, PLAN), f"{arch}: last logits")
        assert cache.tokens == held + prompt == alone.tokens
        assert cache.num_tokens == len(held) + len(prompt)
        assert_logits_close(
            cache.forward(model, NEXT), alone.forward(model, NEXT), f"{arch}: the K/V after"
        )


def test_one_token_prompts_take_only_the_last_step(loaded_tiny):
    model = loaded_tiny("llama").model
    rows = [([1, 2, 3], [4]), ([], [9])]
    caches = [_cache_holding(model, held) for held, _ in rows]
    got = prefill_together(model, caches, [prompt for _, prompt in rows])
    for (held, prompt), cache, logits in zip(rows, caches, got, strict=True):
        alone = _cache_holding(model, held)
        assert_logits_close(logits, prefill(model, alone, prompt, PLAN), "one-token prompts")
        assert cache.tokens == held + prompt


class _FailingAt:
    """The model, raising at its `call`-th call (1: the prompts' pass, 2: the last tokens')."""

    def __init__(self, model, call):
        self._model, self._call, self.calls = model, call, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self._call:
            raise RuntimeError("broken pass")
        return self._model(*args, **kwargs)


@pytest.mark.parametrize("failing_call", [1, 2])
def test_a_failed_pass_leaves_every_cache_as_it_was(loaded_tiny, failing_call):
    model = loaded_tiny("llama").model
    caches = [_cache_holding(model, held) for held, _ in ROWS]
    with pytest.raises(RuntimeError, match="broken pass"):
        prefill_together(_FailingAt(model, failing_call), caches, [p for _, p in ROWS])
    for (held, _), cache in zip(ROWS, caches, strict=True):
        assert cache.tokens == held
        if held:
            want = _cache_holding(model, held).forward(model, NEXT)
            assert_logits_close(cache.forward(model, NEXT), want, "a cache after a failed pass")


def test_refuses_caches_that_cannot_batch_and_empty_prompts(loaded_tiny):
    llama = loaded_tiny("llama").model
    with pytest.raises(ValueError, match="non-empty prompt"):
        prefill_together(llama, [make_cache(llama)], [[]])
    lfm2 = loaded_tiny("lfm2").model  # recurrent state, not known to read its lengths
    with pytest.raises(ValueError, match="float KVCache or sliding-window"):
        prefill_together(lfm2, [make_cache(lfm2), make_cache(lfm2)], [[1], [2]])
    quantized = [make_cache(llama, kv_bits=8, kv_group_size=32) for _ in range(2)]
    with pytest.raises(ValueError, match="float KVCache or sliding-window"):
        prefill_together(llama, quantized, [[1], [2]])
