"""Prompts prefilled together on every architecture of the conformance sweep with sliding
windows or recurrent state (`mlxkv.testing.architectures.EXPECTED_LAYERS`), against each row
fed alone as `fill_prompt` feeds it: the same last-token log-probabilities, the same
checkpoints and disk-tier snapshots (each continuing as the alone one does), the same K/V
after. Recurrent state goes together only where the probe at load finds the model reads
`ArraysCache.lengths`; the probe must refuse the models whose state takes the padding in."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxkv.cache.batched import can_prefill_together
from mlxkv.cache.building import make_cache
from mlxkv.cache.layer_ops import copy_layer
from mlxkv.config import RunnerConfig
from mlxkv.decoding.prefill.batched import Stops, prefill_together
from mlxkv.decoding.prefill.chunks import PrefillPlan, fill, prefill
from mlxkv.models.loading import load_model
from mlxkv.runner.assembly import probe_padded_state
from mlxkv.testing.architectures import EXPECTED_LAYERS
from mlxkv.testing.factory import build_model
from tests.tolerances import LOGPROB_ABS, assert_logits_close

STATEFUL = sorted(arch for arch, kinds in EXPECTED_LAYERS.items() if kinds - {"KVCache"})
PLAN = PrefillPlan(512)
EVERY = 16  # the disk tier's snapshot interval here (tokens): rows cross it, one ends on it
# (tokens held, prompt, where into the prompt it checkpoints): rows of different lengths with
# none, one or two checkpoints, so that some rows feed only padding in a stage
ROWS = [
    ([], list(range(3, 40)), (30,)),
    ([5, 6, 7], [9, 8, 7, 6, 5], (2,)),
    ([], list(range(100, 110)), ()),
    (list(range(50, 60)), list(range(60, 80)), (10, 19)),
    (list(range(200, 220)), list(range(120, 132)), (11,)),  # ends on a boundary (32)
]
NEXT = [61]
# mlx-lm models whose recurrent layers do not read `ArraysCache.lengths` (their state takes
# the padding in; docs/batching.md): the probe must keep them alone
# (nemotron_h reads them where a row is all padding, not where it is partly padding)
READS_PADDING = {
    *("mamba", "jamba", "nemotron_h", "olmo_hybrid", "recurrent_gemma", "rwkv7"),
    "bailing_moe_linear",
}


def _holding(model, tokens):
    cache = make_cache(model)
    cache.snapshot_every_tokens = EVERY
    if tokens:
        fill(model, cache, tokens, PLAN)
    return cache


def _stops(held, prompt, checkpoints) -> Stops:
    start = len(held)
    disk = [n - start for n in range(EVERY, start + len(prompt), EVERY) if n > start]
    return Stops(checkpoints, tuple(disk))


def _alone(model, held, prompt, stops):
    """As `fill_prompt` feeds a prompt alone: split at each stop, checkpoints taken."""
    cache, offset = _holding(model, held), 0
    for split in sorted({*stops.checkpoints, *stops.disk}):
        fill(model, cache, prompt[offset:split], PLAN)
        if split in stops.checkpoints:
            cache.checkpoint()
        offset = split
    return cache, prefill(model, cache, prompt[offset:], PLAN)


def _logprobs(logits):
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _at_snapshot(model, cache, at, snapshot):
    """A cache of `cache`'s first `at` tokens from its disk snapshot there (K/V trimmed)."""
    drop = cache.num_tokens - at
    layers = [
        copy_layer(own, drop) if saved is None else copy_layer(saved)
        for own, saved in zip(cache.layers, snapshot, strict=True)
    ]
    restored = make_cache(model)
    restored.adopt(layers, cache.tokens[:at], {})
    return restored


@pytest.mark.parametrize("arch", STATEFUL)
def test_prompts_prefilled_together_leave_what_each_alone_leaves(tmp_path, arch):
    loaded = load_model(build_model(arch, tmp_path / arch))
    model, empty = loaded.model, make_cache(loaded.model)
    if not can_prefill_together(empty, padded_state_exact=True):
        assert not can_prefill_together(empty)
        pytest.skip(f"{arch}: {sorted(EXPECTED_LAYERS[arch])} prefill alone by design")
    exact = can_prefill_together(empty) or probe_padded_state(loaded, RunnerConfig(), 2)
    assert exact != (arch in READS_PADDING), f"{arch}: the probe said state_exact={exact}"
    if not exact:
        pytest.skip(f"{arch}: its state reads the padding: prefilled alone")
    caches = [_holding(model, held) for held, _, _ in ROWS]
    stops = [_stops(held, prompt, points) for held, prompt, points in ROWS]
    prompts = [prompt for _, prompt, _ in ROWS]
    got = prefill_together(model, caches, prompts, stops=stops, padded_state_exact=True)
    for i, (cache, logits) in enumerate(zip(caches, got, strict=True)):
        held, prompt, _ = ROWS[i]
        alone, want = _alone(model, held, prompt, stops[i])
        token = mx.argmax(want, axis=-1)  # the greedy next token, as decoding reads it
        assert mx.argmax(logits, axis=-1).item() == token.item(), f"{arch} row {i}"
        diff = mx.abs(_logprobs(logits) - _logprobs(want))[0, token].item()
        assert diff <= LOGPROB_ABS, f"{arch} row {i}: its log-probability {diff:.2e} apart"
        assert_logits_close(logits, want, f"{arch} row {i}: last logits")
        assert cache.tokens == alone.tokens
        assert sorted(cache.checkpoints) == sorted(alone.checkpoints), f"{arch} row {i}"
        assert sorted(cache.disk_snapshots) == sorted(alone.disk_snapshots), f"{arch} row {i}"
        for at in sorted(alone.checkpoints):
            assert_logits_close(
                cache.copy_prefix(at).forward(model, NEXT),
                alone.copy_prefix(at).forward(model, NEXT),
                f"{arch} row {i}: from its checkpoint at {at}",
            )
        for at, snapshot in sorted(alone.disk_snapshots.items()):
            assert_logits_close(
                _at_snapshot(model, cache, at, cache.disk_snapshots[at]).forward(model, NEXT),
                _at_snapshot(model, alone, at, snapshot).forward(model, NEXT),
                f"{arch} row {i}: from its disk snapshot at {at}",
            )
        assert_logits_close(
            cache.forward(model, NEXT), alone.forward(model, NEXT), f"{arch} row {i}: after"
        )
