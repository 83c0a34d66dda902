"""Review of the staged batched prefill (`prefill_together` with `Stops`): rows far apart in
length, windows that wrap inside the pass, a row that is one token, a row with many stops
beside rows with none, held prefixes longer than the window; each row against the same row
fed alone as `fill_prompt` feeds it (the helpers of test_prefill_together_layer_kinds)."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from mlxkv.cache.batched import can_prefill_together
from mlxkv.cache.building import make_cache
from mlxkv.config import RunnerConfig
from mlxkv.decoding.prefill.batched import Stops, prefill_together
from mlxkv.models.loading import load_model
from mlxkv.runner.assembly import probe_padded_state
from mlxkv.testing.factory import build_model
from tests.decoding.test_prefill_together_layer_kinds import (
    EVERY,
    NEXT,
    _alone,
    _at_snapshot,
    _holding,
    _logprobs,
)
from tests.tolerances import LOGPROB_ABS, assert_logits_close

ARCHS = [
    "gemma3_text", "spark2_5", "gpt_oss", "lfm2", "qwen3_next", "cohere2", "gemma3n", "plamo2",
    "granitemoehybrid", "kimi_linear", "bailing_hybrid", "olmo3", "mimo_v2_flash", "qwen3_5",
]  # fmt: skip


def _rows(seed: int):
    """(held, prompt, checkpoints) rows: lengths from 1 to several windows, held 0 to 40."""
    rng = random.Random(seed)
    rows = []
    for _ in range(rng.randint(2, 5)):
        held = [rng.randrange(3, 500) for _ in range(rng.choice([0, 0, 3, 9, 17, 40]))]
        prompt = [rng.randrange(3, 500) for _ in range(rng.choice([1, 1, 2, 5, 16, 33, 70]))]
        n = len(prompt)
        points = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(0, 4)))) if n > 1 else []
        rows.append((held, prompt, tuple(points)))
    return rows


def _stops(held, prompt, checkpoints) -> Stops:
    start = len(held)
    disk = [n - start for n in range(EVERY, start + len(prompt), EVERY) if n > start]
    return Stops(checkpoints, tuple(disk))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("seed", range(12))
def test_rows_far_apart_prefilled_together_as_alone(tmp_path, arch, seed):
    loaded = load_model(build_model(arch, tmp_path / arch))
    model, empty = loaded.model, make_cache(loaded.model)
    exact = can_prefill_together(empty) or probe_padded_state(loaded, RunnerConfig(), 2)
    if not exact:
        pytest.skip(f"{arch}: prefilled alone")
    rows = _rows(seed)
    caches = [_holding(model, held) for held, _, _ in rows]
    stops = [_stops(*row) for row in rows]
    prompts = [prompt for _, prompt, _ in rows]
    got = prefill_together(model, caches, prompts, stops=stops, padded_state_exact=True)
    for i, (cache, logits) in enumerate(zip(caches, got, strict=True)):
        held, prompt, _ = rows[i]
        where = f"{arch} seed {seed} row {i} (held {len(held)}, prompt {len(prompt)})"
        alone, want = _alone(model, held, prompt, stops[i])
        token = mx.argmax(want, axis=-1)
        diff = mx.abs(_logprobs(logits) - _logprobs(want))[0, token].item()
        assert diff <= LOGPROB_ABS, f"{where}: log-probability {diff:.2e} apart"
        assert_logits_close(logits, want, f"{where}: last logits")
        assert cache.tokens == alone.tokens
        assert sorted(cache.checkpoints) == sorted(alone.checkpoints), where
        assert sorted(cache.disk_snapshots) == sorted(alone.disk_snapshots), where
        for at in sorted(alone.checkpoints):
            assert_logits_close(
                cache.copy_prefix(at).forward(model, NEXT),
                alone.copy_prefix(at).forward(model, NEXT),
                f"{where}: from its checkpoint at {at}",
            )
        for at, snapshot in sorted(alone.disk_snapshots.items()):
            assert_logits_close(
                _at_snapshot(model, cache, at, cache.disk_snapshots[at]).forward(model, NEXT),
                _at_snapshot(model, alone, at, snapshot).forward(model, NEXT),
                f"{where}: from its disk snapshot at {at}",
            )
        assert_logits_close(cache.forward(model, NEXT), alone.forward(model, NEXT), where)
        # and a few decode steps on after, one token at a time (the window keeps rotating)
        for token in (7, 8, 9):
            assert_logits_close(
                cache.forward(model, [token]), alone.forward(model, [token]), f"{where} +{token}"
            )
