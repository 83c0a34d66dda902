"""An entry kept within `cache_bytes` keeps what fits, whatever the budget's size against one
growth step and whatever the K/V's storage: a budget under one step (256 tokens) kept nothing
(the allocation only shrank to a step boundary), and quantized K/V never shrank at all."""

from __future__ import annotations

import pytest

from mlxkv import Runner

PROMPT = [5 + (i * 7) % 200 for i in range(120)]
REPLY_TOKENS = 4

# (model, kv_bits): float K/V, and 8-bit K/V on the tiny llama whose head size (64) quantizes
KINDS = [("llama", None), ("quantizable", 8)]
# the budget against the bytes turn 1's entry uses: all of it fits, or a bit more than half
SHARES = {"whole": 1.1, "part": 0.6}


@pytest.mark.parametrize("share", list(SHARES))
@pytest.mark.parametrize(("model", "kv_bits"), KINDS, ids=[m for m, _ in KINDS])
def test_an_entry_over_its_byte_budget_keeps_what_fits(
    loaded_tiny, loaded_quantizable, model, kv_bits, share
):
    loaded = loaded_quantizable if model == "quantizable" else loaded_tiny(model)
    options = {"max_context": 1024, "kv_bits": kv_bits, "speculative": None}
    unlimited = Runner(loaded, **options)
    first = unlimited.generate(PROMPT, max_tokens=REPLY_TOKENS)
    held = unlimited.cache_info()
    budget = int(held.used_bytes * SHARES[share])
    assert budget < held.allocated_bytes, "the entry should fill less than one growth step"

    runner = Runner(loaded, cache_bytes=budget, **options)
    assert runner.generate(PROMPT, max_tokens=REPLY_TOKENS).tokens == first.tokens
    kept = runner.cache_info()
    assert kept.held_bytes <= budget
    next_turn = PROMPT + first.tokens + [7, 8, 9]
    out = runner.generate(next_turn, max_tokens=REPLY_TOKENS)
    want = held.num_tokens if share == "whole" else int(held.num_tokens * SHARES[share] * 0.9)
    assert out.cached_tokens == kept.num_tokens >= want, f"kept {kept.num_tokens} of {held}"
    fresh = Runner(loaded, **options).generate(next_turn, max_tokens=REPLY_TOKENS)
    assert out.tokens == fresh.tokens
