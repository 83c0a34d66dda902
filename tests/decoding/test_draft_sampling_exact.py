"""Sampled drafting through the request's processors keeps the model's distribution
(speculative sampling is exact for any q, provided q is what the draft was sampled from):
with a logit bias and a presence penalty, a draft model near the model (its weights with
noise: about a fifth of its drafts accepted) gives the tokens plain sampling gives, in
distribution. Seeded requests, so the counts are the same each run. The bound on the total
variation distance at the token after the first (300 samples each) sits between what this
gives (0.08) and a q reported without the processors while the draft was sampled with them
(0.39; review rs11)."""

from __future__ import annotations

import collections
import shutil

import mlx.core as mx
import pytest

from mlxkv import Runner
from mlxkv.models.loading import load_model
from tests.factories import tiny_model_dir

NUM_SAMPLES = 300
# the first token is the prompt's last logits' (never drafted); the second can be a draft
OPTIONS = {
    "temperature": 0.8,
    "top_k": 4,
    "logit_bias": {178: 3.0, 394: 3.0, 220: 3.0},  # among the likeliest tokens there
    "presence_penalty": 2.0,
    "max_tokens": 3,  # 2 would leave no room for a draft
}
MAX_TOTAL_VARIATION = 0.2


@pytest.fixture(scope="module")
def noisy_draft(model_root, tmp_path_factory):
    """The tiny llama with noise (0.15 of each matrix's spread) added to its weights."""
    source = tiny_model_dir("llama", model_root)
    out = tmp_path_factory.mktemp("noisy") / "llama"
    shutil.copytree(source, out)
    weights = mx.load(str(source / "model.safetensors"))
    key = mx.random.key(3)
    for name, value in weights.items():
        if value.ndim == 2:
            key, sub = mx.random.split(key)
            noise = mx.random.normal(value.shape, key=sub)
            weights[name] = value + 0.15 * value.std() * noise
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return load_model(out)


def _second_tokens(runner, seeds, **options) -> tuple[collections.Counter, int]:
    """How often each token came second, and how many drafts were accepted."""
    counts, accepted = collections.Counter(), 0
    for seed in seeds:
        completion = runner.generate("one two three", seed=seed, **OPTIONS, **options)
        counts[completion.tokens[1]] += 1
        accepted += completion.accepted_tokens
    return counts, accepted


def test_sampled_drafts_through_the_processors_keep_the_models_distribution(
    loaded_tiny, noisy_draft
):
    loaded = loaded_tiny("llama")
    plain, _ = _second_tokens(Runner(loaded, max_context=512, speculative=None), range(NUM_SAMPLES))
    runner = Runner(loaded, max_context=512, draft=noisy_draft)
    seeds = range(10**6, 10**6 + NUM_SAMPLES)
    drafted, accepted = _second_tokens(runner, seeds, speculative="draft")
    assert NUM_SAMPLES // 10 < accepted < NUM_SAMPLES, "a draft too far or too near the model"
    distance = sum(abs(plain[t] - drafted[t]) for t in plain | drafted) / (2 * NUM_SAMPLES)
    assert distance < MAX_TOTAL_VARIATION, (distance, plain, drafted)
