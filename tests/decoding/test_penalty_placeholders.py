"""The logits processors `SamplingParams` makes read only the history's ids within the logits:
a vision prompt's image placeholders (past the vocabulary) are skipped, where mlx-lm's
repetition penalty gathered and scattered out of bounds (SIGSEGV); other ids are penalized
exactly as mlx-lm's processor penalizes them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import make_logits_processors

from mlxkv.decoding.sampling import SamplingParams
from mlxkv.models.vision import PLACEHOLDER_BASE


def _logits(width: int = 64) -> mx.array:
    return mx.array(np.random.default_rng(0).normal(size=(1, width)).astype(np.float32))


def test_a_history_of_tokens_is_penalized_as_mlx_lm_does():
    history = mx.array([3, 5, 5, 60, 7] * 6, dtype=mx.uint32)  # longer than its 20-token window
    (ours,) = SamplingParams(repetition_penalty=1.3).make_logits_processors(placeholders=True)
    (theirs,) = make_logits_processors(repetition_penalty=1.3)
    assert mx.array_equal(ours(history, _logits()), theirs(history, _logits()))


def test_placeholders_in_the_history_are_skipped():
    placeholders = [PLACEHOLDER_BASE, PLACEHOLDER_BASE + 1, 64]  # 64: just past the logits
    history = mx.array([3, *placeholders, 5, 9], dtype=mx.uint32)
    (ours,) = SamplingParams(repetition_penalty=1.3).make_logits_processors(placeholders=True)
    (theirs,) = make_logits_processors(repetition_penalty=1.3)
    want = theirs(mx.array([3, 5, 9], dtype=mx.uint32), _logits())
    got = ours(history, _logits())
    assert got.shape == (1, 64)
    assert mx.array_equal(got, want)
