"""Feeding prompt tokens into a ModelCache in chunks.

Owns `fill` (tokens into the cache, no logits) and `prefill` (the same, then the last token's
logits). On MLX's CPU backend each chunk is spread over the cores (`lanes`). Does not own
which tokens to feed (`mlxkv.engine.prompt_fill`) or the cache's bookkeeping (`ModelCache`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn

from mlxkv.cache.model_cache import ModelCache
from mlxkv.decoding import lanes

ProgressCallback = Callable[[int, int], None]


def fill(
    model: nn.Module,
    cache: ModelCache,
    tokens: Sequence[int],
    *,
    step_tokens: int,
    progress: ProgressCallback | None = None,
) -> None:
    """Feeds `tokens` into the cache in chunks of at most `step_tokens`, computing no logits:
    only the cache's arrays are evaluated, so MLX never runs the vocabulary projection for them
    (as in mlx-lm). On the CPU backend each chunk is spread over the cores (`lanes`).

    Args:
        progress: called as progress(done, len(tokens)) in tokens after each chunk.
    """
    total = len(tokens)
    for start in range(0, total, step_tokens):
        end = min(start + step_tokens, total)
        lanes.feed(model, cache, tokens[start:end])
        if progress:
            progress(end, total)
        mx.clear_cache()


def prefill(
    model: nn.Module,
    cache: ModelCache,
    tokens: Sequence[int],
    *,
    step_tokens: int,
    progress: ProgressCallback | None = None,
) -> mx.array:
    """Feeds `tokens` through the model: all but the last with `fill`, the last alone for the
    logits generation starts from.

    Args:
        tokens: at least one token id, fed after what `cache` holds (which grows in place).
        progress: called as progress(done, total) in tokens after each chunk.

    Returns:
        Logits of the last token, shape (1, vocab), lazy.
    """
    total = len(tokens)
    body_progress = (lambda done, _: progress(done, total)) if progress else None
    fill(model, cache, tokens[:-1], step_tokens=step_tokens, progress=body_progress)
    logits = cache.forward(model, tokens[-1:])[:, -1, :]
    if progress:
        progress(total, total)
    return logits
