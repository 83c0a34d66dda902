"""Review: sliding-window prompts prefilled together where a stage of the batched pass feeds
one token to some rows and none to others (a 2-token prompt beside a 1-token one, or a row
whose last stage before its final token is one token): mlx-lm's `BatchRotatingKVCache` takes
a (B, 1) input as a decode step (`_update_in_place`), which refuses a cache prepared with right
padding. The requests must answer as each alone."""

from __future__ import annotations

import pytest

from mlxkv import Runner
from mlxkv.cache.building import make_cache
from mlxkv.decoding.prefill.batched import Stops, prefill_together
from mlxkv.decoding.prefill.chunks import PrefillPlan, prefill
from tests.decoding.test_prefill_together_layer_kinds import NEXT, _alone, _holding
from tests.runner.test_batching import (
    _assert_same_answers,
    _first_jobs_queued_then_run,
    _tokens_and_logprobs,
)
from tests.tolerances import assert_logits_close

WINDOWED = ["gemma3_text", "spark2_5", "gpt_oss"]


@pytest.mark.parametrize("arch", WINDOWED)
@pytest.mark.parametrize(
    ("prompts", "stops"),
    [
        ([[5, 6], [7]], [Stops(), Stops()]),  # one token fed before the last, beside none
        ([[5, 6, 7, 8], [9, 10, 11]], [Stops((2,)), Stops()]),  # a last stage of one token
    ],
)
def test_a_stage_of_one_token_beside_padding(loaded_tiny, arch, prompts, stops):
    model = loaded_tiny(arch).model
    caches = [make_cache(model) for _ in prompts]
    got = prefill_together(model, caches, prompts, stops=stops)
    for prompt, logits in zip(prompts, got, strict=True):
        want = prefill(model, make_cache(model), prompt, PrefillPlan(512))
        assert_logits_close(logits, want, f"{arch} {prompt}")


@pytest.mark.parametrize("arch", WINDOWED)
def test_requests_of_two_and_one_tokens_together_answer_as_alone(loaded_tiny, arch):
    loaded = loaded_tiny(arch)
    prompts = [[11, 12], [13]]
    options = {"max_tokens": 6, "temperature": 0.0, "logprobs": 0}
    alone = Runner(loaded, max_context=512, speculative=None)
    want = [_tokens_and_logprobs(alone.stream(p, **options)) for p in prompts]
    runner = Runner(loaded, max_context=512, cache_entries=8, max_batch=4)
    got = _first_jobs_queued_then_run(runner, prompts, [options] * len(prompts))
    assert None not in got, "a request failed (its thread raised)"
    _assert_same_answers(got, want)


@pytest.mark.parametrize("arch", WINDOWED)
def test_a_stage_of_one_token_for_every_row_then_a_wider_one(loaded_tiny, arch):
    """Every row feeds one token in the first stage (a checkpoint one token in; no padding),
    the rows holding 10 and 3 tokens (past and within the window of 8): the (B, 1) stage is a
    decode step to the windows, after which the next stage's multi-token pass misplaced a row
    (Gemma 3: last logits 4 apart)."""
    model = loaded_tiny(arch).model
    held = [list(range(30, 40)), [1, 2, 3]]
    prompts = [list(range(5, 25)), list(range(100, 120))]
    stops = [Stops((1,)), Stops((1,))]
    caches = [_holding(model, tokens) for tokens in held]
    got = prefill_together(model, caches, prompts, stops=stops)
    for i, (cache, logits) in enumerate(zip(caches, got, strict=True)):
        alone, want = _alone(model, held[i], prompts[i], stops[i])
        assert_logits_close(logits, want, f"{arch} row {i}")
        for at in sorted(alone.checkpoints):
            assert_logits_close(
                cache.copy_prefix(at).forward(model, NEXT),
                alone.copy_prefix(at).forward(model, NEXT),
                f"{arch} row {i}: from its checkpoint at {at}",
            )
        assert_logits_close(cache.forward(model, NEXT), alone.forward(model, NEXT), f"row {i}")
