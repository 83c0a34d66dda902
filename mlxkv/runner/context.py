"""Living within the context window: fitting prompts, and shifting the cache when full.

Owns:
  - `fit_prompt`: a prompt longer than the window is cut from the front, keeping the first
    `keep` tokens (for chat messages: whole messages are dropped, oldest first, after the system
    prompt, so no template marker is split);
  - `ContextWindow.make_room`: when generation reaches the window, keep the first `keep`
    tokens, drop half of the rest and go on. Where every layer is a float KVCache with a RoPE
    whose angle is linear in the position (plain RoPE, traditional or not, linear scaling, and
    Llama 3 frequency scaling), the remaining keys are rotated back in place: RoPE composes, so
    a key rotated for position p and then by -d equals one rotated for p - d. Elsewhere
    (sliding-window or recurrent layers, quantized K/V, other RoPE kinds such as YaRN or
    LongRoPE, which are not claimed) the cache is cleared and the kept tokens prefilled again.

What a shift cannot restore: deeper layers' K/V of the kept tokens were computed while the
dropped tokens were in context. That approximation is the same in llama.cpp and Ollama; only
the first layer (and a one-layer model) equals a fresh prefill of the kept tokens exactly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import Llama3RoPE

from mlxkv.cache.kv import Rotation
from mlxkv.cache.model_cache import ModelCache
from mlxkv.cache.prefix import common_prefix_length
from mlxkv.errors import ContextLengthError

logger = logging.getLogger(__name__)

DEFAULT_KEEP_TOKENS = 4  # without a system prompt; as llama.cpp's attention sinks


def rope_rotations(model: nn.Module) -> list[Rotation | None]:
    """Per layer, a function re-rotating cached keys by a position delta, or None where the
    layer has no RoPE that mlxkv can shift exactly."""
    return [_rotation(_rope_of(layer)) for layer in model.layers]


def _rope_of(layer: Any) -> Any:
    attention = getattr(layer, "self_attn", None) or getattr(layer, "attention", None)
    return getattr(attention, "rope", None)


def _rotation(rope: Any) -> Rotation | None:
    if type(rope) is nn.RoPE:
        kwargs = {"base": rope.base, "scale": rope.scale}
    elif type(rope) is Llama3RoPE:
        kwargs = {"base": None, "scale": 1.0, "freqs": rope._freqs}
    else:
        return None

    def rotate(keys: mx.array, delta: int) -> mx.array:
        # One position per token: the sequence axis becomes a batch axis of length-1 sequences.
        per_token = keys[..., None, :]  # (B, H, L, 1, D)
        turned = mx.fast.rope(
            per_token, rope.dims, traditional=rope.traditional, offset=delta, **kwargs
        )
        return turned.squeeze(-2)

    return rotate


def check_keep(keep: int, budget: int) -> None:
    """Raises ContextLengthError when `keep` leaves no room in a window of `budget` tokens."""
    if keep >= budget:
        raise ContextLengthError(
            f"keep is {keep} tokens but only {budget} fit in the context; "
            "lower keep (or shorten the system prompt) or raise max_context"
        )


def fit_prompt(
    tokens: list[int],
    budget: int,
    keep: int,
    *,
    held: Sequence[int] = (),
    render_from: Callable[[int], list[int]] | None = None,
    num_messages: int = 0,
    first_droppable: int = 0,
    cut_points: Sequence[int] = (),
) -> list[int]:
    """Returns `tokens` cut to at most `budget` tokens, keeping the first `keep`.

    For chat messages (`render_from` given), whole messages are dropped after the system
    prompt. Among the cuts that fit, the one sharing the longest prefix with what the cache
    `held` is taken, so a conversation that already lives cut in the cache is reused exactly.
    When no cut reuses a quarter of the budget, the cut goes deep enough to fit in half the
    budget instead, so the next turns find the same start in the cache rather than missing on
    every turn (the cost of a cut is paid once per half window, not once per turn).

    Args:
        held: the token ids the prompt cache holds.
        render_from: renders the prompt keeping messages[:first_droppable] and messages[i:].
        num_messages: how many messages there are.
        first_droppable: index of the first message that may be dropped.
        cut_points: message indices a cut may start at (default: any after first_droppable);
            chat templates expect the kept history to start with a user message.

    Raises:
        ContextLengthError: `keep` leaves no room in the budget.
    """
    check_keep(keep, budget)
    if len(tokens) <= budget:
        return tokens
    fitting = []
    if render_from is not None:
        for first in cut_points or range(first_droppable + 1, num_messages):
            candidate = render_from(first)
            if len(candidate) <= budget:
                fitting.append((first, candidate))
    if fitting:
        first, chosen = max(fitting, key=lambda fc: common_prefix_length(held, fc[1]))
        if common_prefix_length(held, chosen) < budget // 4:  # not a cut the cache holds
            first, chosen = next((fc for fc in fitting if len(fc[1]) <= budget // 2), fitting[-1])
        logger.info(
            "context: dropped %d oldest messages (%d tokens) to fit %d tokens",
            first - first_droppable,
            len(tokens) - len(chosen),
            budget,
        )
        return chosen
    cut = len(tokens) - budget
    logger.info("context: dropped %d tokens after the first %d to fit %d tokens", cut, keep, budget)
    return tokens[:keep] + tokens[keep + cut :]


@dataclass
class ContextWindow:
    """The window one request generates in.

    Attributes:
        max_context: most tokens the cache may hold.
        keep: tokens at the start that a shift never drops.
        rotations: per-layer key rotations (`rope_rotations`); None entries force reprocessing.
        refill: feeds tokens into the cache without sampling (used when a shift reprocesses).
    """

    max_context: int
    keep: int
    rotations: Sequence[Rotation | None]
    refill: Callable[[ModelCache, list[int]], None]
    shifts: int = 0

    def make_room(self, cache: ModelCache, num_new: int) -> None:
        """Shifts the cache if feeding `num_new` more tokens would overflow the window."""
        held = cache.num_tokens
        if held + num_new <= self.max_context:
            return
        drop = max((held - self.keep) // 2, held + num_new - self.max_context)
        self.shifts += 1
        if cache.can_shift(self.rotations):
            cache.shift(self.keep, drop, self.rotations)
            logger.info(
                "context shift: kept %d + %d tokens, dropped %d",
                self.keep,
                held - self.keep - drop,
                drop,
            )
            return
        kept = cache.tokens
        del kept[self.keep : self.keep + drop]
        cache.free()
        self.refill(cache, kept)
        logger.info(
            "context shift by reprocessing %d tokens (dropped %d): this model's cache cannot "
            "be rotated in place",
            len(kept),
            drop,
        )
