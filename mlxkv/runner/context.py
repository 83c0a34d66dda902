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


def fit_prompt(
    tokens: list[int],
    max_tokens_in_context: int,
    keep: int,
    render_from: Callable[[int], list[int]] | None = None,
    num_messages: int = 0,
    first_droppable: int = 0,
) -> list[int]:
    """Returns `tokens` cut to at most `max_tokens_in_context`, keeping the first `keep`.

    Args:
        render_from: for chat messages, renders the prompt with messages[first_droppable:i]
            dropped, for i = first_droppable + 1, ...; messages are dropped whole, oldest first,
            while more than the last one remains.
        num_messages: how many messages `render_from` may drop from.
        first_droppable: index of the first message that may be dropped (after the system
            prompt).

    Raises:
        ContextLengthError: `keep` leaves no room in the window.
    """
    if keep >= max_tokens_in_context:
        raise ContextLengthError(
            f"keep is {keep} tokens but only {max_tokens_in_context} fit in the context; "
            "lower keep (or shorten the system prompt) or raise max_context"
        )
    if len(tokens) <= max_tokens_in_context:
        return tokens
    original = len(tokens)
    if render_from is not None:
        for first_kept in range(first_droppable + 1, num_messages):
            tokens = render_from(first_kept)
            if len(tokens) <= max_tokens_in_context:
                logger.info(
                    "context: dropped %d oldest messages (%d tokens) to fit %d tokens",
                    first_kept - first_droppable,
                    original - len(tokens),
                    max_tokens_in_context,
                )
                return tokens
    cut = len(tokens) - max_tokens_in_context
    logger.info(
        "context: dropped %d tokens after the first %d to fit %d tokens",
        cut,
        keep,
        max_tokens_in_context,
    )
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
