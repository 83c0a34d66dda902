"""The default decode batch (`default_max_batch`): as many rows as fit in
`BATCH_MEMORY_FRACTION` of memory, each row what a cache holding a whole window holds: K/V for
every token and a recurrent layer's state once (not once per token: LFM2's state is 6 times
its K/V per token, so a row of LFM2 was counted 7 times its bytes)."""

from __future__ import annotations

import pytest

from mlxkv.cache.checkpoints import MAX_CHECKPOINTS
from mlxkv.config import BATCH_MEMORY_FRACTION, RunnerConfig
from mlxkv.decoding.prefill.chunks import PrefillPlan, fill
from mlxkv.runner.assembly import (
    default_max_batch,
    default_max_context,
    make_layers,
    measure_one_token,
)

WINDOW_TOKENS = 96


@pytest.mark.parametrize("arch", ["llama", "lfm2", "qwen3_5", "mamba"])
def test_rows_are_sized_by_what_a_full_window_holds(loaded_tiny, arch):
    model = loaded_tiny(arch).model
    _, cost = measure_one_token(model, make_layers(model, RunnerConfig()))
    full = make_layers(model, RunnerConfig())
    fill(model, full, list(range(10, 10 + WINDOW_TOKENS)), PrefillPlan(512))
    row_bytes = full.used_bytes  # the reference: a cache holding the whole window
    for rows in (1, 3, 7):
        memory = round(rows * row_bytes / BATCH_MEMORY_FRACTION)
        assert default_max_batch(WINDOW_TOKENS, cost, memory) == rows
        assert default_max_batch(WINDOW_TOKENS, cost, memory - 64) == max(1, rows - 1)


@pytest.mark.parametrize("arch", ["llama", "lfm2", "gemma3_text", "qwen3_5"])
def test_the_default_window_is_what_the_budget_holds(loaded_tiny, arch):
    """`default_max_context` within a budget: the tokens whose K/V, beside the state layers
    full (a window's whole window, a recurrent state) and their checkpoints, fill it. The
    one-token measure counted LFM2's state once per token and Gemma 3's windows as growing."""
    model = loaded_tiny(arch).model
    one_token_bytes, cost = measure_one_token(model, make_layers(model, RunnerConfig()))
    tokens = 192  # past the tiny models' windows
    full = make_layers(model, RunnerConfig())
    fill(model, full, list(range(10, 10 + tokens - 1)), PrefillPlan(512))
    full.forward(model, [5])  # decoded: a window holds its window (a prefill chunk, briefly more)
    budget = full.used_bytes + MAX_CHECKPOINTS * cost.snapshot_bytes
    assert default_max_context(None, cost, 0, one_token_bytes, budget) == tokens
    assert default_max_context(tokens // 2, cost, 0, one_token_bytes, budget) == tokens // 2
