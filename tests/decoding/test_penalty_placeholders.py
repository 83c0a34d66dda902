"""The logits processors `SamplingParams` makes (repetition, presence and frequency penalties,
logit bias) are mlx-lm's; for a prompt with images they read only the history's ids within the
logits: a vision prompt's image placeholders (past the vocabulary) are skipped, where mlx-lm's
penalties gathered and scattered out of bounds (SIGSEGV); other ids are processed exactly as
mlx-lm's processors process them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_logits_processors

from mlxkv.decoding.sampling import SamplingParams
from mlxkv.models.vision import PLACEHOLDER_BASE


def _logits(width: int = 64) -> mx.array:
    return mx.array(np.random.default_rng(0).normal(size=(1, width)).astype(np.float32))


SETTINGS = [
    {"repetition_penalty": 1.3},
    {"presence_penalty": 0.7},
    {"frequency_penalty": -0.4},
    {"logit_bias": {5: 3.0, 60: -100.0}},
]
IDS = ["repetition", "presence", "frequency", "logit-bias"]


def _both(settings: dict, placeholders: bool):
    (ours,) = SamplingParams(**settings).make_logits_processors(placeholders=placeholders)
    (theirs,) = make_logits_processors(**settings)
    return ours, theirs


@pytest.mark.parametrize("placeholders", [True, False], ids=["image-prompt", "text-prompt"])
@pytest.mark.parametrize("settings", SETTINGS, ids=IDS)
def test_a_history_of_tokens_is_processed_as_mlx_lm_does(settings, placeholders):
    history = mx.array([3, 5, 5, 60, 7] * 6, dtype=mx.uint32)  # longer than its 20-token window
    ours, theirs = _both(settings, placeholders)
    assert mx.array_equal(ours(history, _logits()), theirs(history, _logits()))


@pytest.mark.parametrize("settings", SETTINGS, ids=IDS)
def test_placeholders_in_the_history_are_skipped(settings):
    placeholders = [PLACEHOLDER_BASE, PLACEHOLDER_BASE + 1, 64]  # 64: just past the logits
    history = mx.array([3, *placeholders, 5, 9], dtype=mx.uint32)
    ours, theirs = _both(settings, placeholders=True)
    want = theirs(mx.array([3, 5, 9], dtype=mx.uint32), _logits())
    got = ours(history, _logits())
    assert got.shape == (1, 64)
    assert mx.array_equal(got, want)
