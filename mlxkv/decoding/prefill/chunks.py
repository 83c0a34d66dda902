"""Feeding prompt tokens into a ModelCache in chunks.

Owns `PrefillPlan` (chunk size and lanes for the device), `fill` (tokens into the cache, no
logits) and `prefill` (the same, then the last token's logits), each also as a generator that
pauses after every chunk, yielding the tokens fed so far (`fill_steps`, `prefill_steps`: a
request interleaved with others lets them run between its chunks, and reports its progress),
and scoring each chunk's positions where the prompt's own log-probabilities are asked for.
On MLX's CPU backend each chunk is spread over the cores (`lanes`). Does not own which
tokens to feed (`mlxkv.runner.prefill.fill`) or the cache's bookkeeping (`ModelCache`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from mlxkv.cache.model_cache import ModelCache
from mlxkv.decoding.prefill import lanes as cpu_lanes
from mlxkv.decoding.prefill.scoring import PromptScorer
from mlxkv.platform.machine import memory_bytes, on_gpu

ProgressCallback = Callable[[int, int], None]

# Most prompt tokens per model call when none is set. On a CPU, attention over one long chunk
# costs more than over several short ones (measured: 2,048 tokens 1.5x faster in 512-token
# chunks); mlx-lm uses 2,048 everywhere.
DEFAULT_STEP_TOKENS_CPU = 512
DEFAULT_STEP_TOKENS_GPU = 2048
# MLX keeps freed buffers for reuse. Giving them back after every chunk cost about 20% of
# prefill time on a GPU (mlx-lm's too); they are given back only once they pass this share of
# the machine's memory.
KEPT_BUFFERS_MEMORY_FRACTION = 1 / 16


@dataclass(frozen=True)
class PrefillPlan:
    """How prompt tokens are fed, decided once per Runner.

    Attributes:
        step_tokens: most tokens per model call.
        lanes: CPU streams a chunk is spread over (1: one stream).
        kept_buffers_bytes: after a chunk, MLX's buffers kept for reuse are given back when
            they hold more than this (0: after every chunk).
    """

    step_tokens: int
    lanes: int = 1
    kept_buffers_bytes: int = 0

    @classmethod
    def make(
        cls,
        step_tokens: int | None = None,
        lanes: int | None = None,
        *,
        window_tokens: int | None = None,
    ) -> PrefillPlan:
        """The plan for this device: the given settings, else the device's defaults; a step
        never longer than the context window (`window_tokens`)."""
        if step_tokens is None:
            step_tokens = DEFAULT_STEP_TOKENS_GPU if on_gpu() else DEFAULT_STEP_TOKENS_CPU
        if window_tokens is not None:
            step_tokens = min(step_tokens, window_tokens)
        lanes = cpu_lanes.default_lanes() if lanes is None else lanes
        return cls(step_tokens, lanes, int(memory_bytes() * KEPT_BUFFERS_MEMORY_FRACTION))


def fill(model: nn.Module, cache: ModelCache, tokens: Sequence[int], plan: PrefillPlan) -> None:
    """Feeds `tokens` into the cache in chunks of at most `plan.step_tokens`, computing no logits
    (`ModelCache.feed`). On the CPU backend each chunk is spread over the cores
    (`lanes`)."""
    for _ in fill_steps(model, cache, tokens, plan):
        pass


def fill_steps(
    model: nn.Module,
    cache: ModelCache,
    tokens: Sequence[int],
    plan: PrefillPlan,
    scorer: PromptScorer | None = None,
) -> Generator[int, None, None]:
    """`fill`, pausing after each chunk, where it yields the tokens fed so far; closing it
    stops after the chunk fed. With a `scorer`, each chunk's logits are computed and scored
    (one lane: every position's logits are read)."""
    total = len(tokens)
    for start in range(0, total, plan.step_tokens):
        end = min(start + plan.step_tokens, total)
        if scorer is None:
            cpu_lanes.feed(model, cache, tokens[start:end], plan.lanes)
        else:
            at = cache.num_tokens
            kept = scorer.score(cache.forward(model, tokens[start:end]), at)
            mx.eval(cache.arrays(), *kept)
        if mx.get_cache_memory() > plan.kept_buffers_bytes:
            mx.clear_cache()
        yield end


def prefill(
    model: nn.Module, cache: ModelCache, tokens: Sequence[int], plan: PrefillPlan
) -> mx.array:
    """Feeds `tokens` through the model: all but the last with `fill`, the last alone for the
    logits generation starts from.

    Args:
        tokens: at least one token id, fed after what `cache` holds (which grows in place).

    Returns:
        Logits of the last token, shape (1, vocab), lazy.
    """
    steps = prefill_steps(model, cache, tokens, plan)
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value


def prefill_steps(
    model: nn.Module,
    cache: ModelCache,
    tokens: Sequence[int],
    plan: PrefillPlan,
    scorer: PromptScorer | None = None,
) -> Generator[int, None, mx.array]:
    """`prefill`, pausing after each chunk but the last token, where it yields the tokens fed
    so far; returns the logits (all `tokens` fed). `scorer`: as `fill_steps`."""
    yield from fill_steps(model, cache, tokens[:-1], plan, scorer)
    return cache.forward(model, tokens[-1:])[:, -1, :]
