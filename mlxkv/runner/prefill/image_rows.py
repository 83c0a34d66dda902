"""Several prompts of one vision model fed as the rows of one batched call, prompts with images
among them: what lets a vision model's prompts with images be prefilled together (the group,
`group`, hands it to `mlxkv.decoding.prefill.batched.prefill_together`, which calls it as it
calls any model).

Owns `PromptRows`. A prompt with images runs through its own `ImagePrompt` (its encoder rows
spliced over its images' tokens, its M-RoPE positions); in a batch each row needs its own, at
its own offset, while the language model takes one (B, L, hidden) tensor of embeddings, one
(3, B, L) of positions and one deepstack mask. `PromptRows` builds each row's part from the
row's offset in the batched cache (its tokens, left padding not counted) and stacks them. Does
not own the batch's layers, padding or rolling (`mlxkv.cache.batched`), nor one prompt's
splice (`ImagePrompt.row_inputs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxkv.models.vision import ImagePrompt, RowInputs, VisionLanguageModel
from mlxkv.models.vision_families import Deepstack


class PromptRows:
    """A vision model called with a batch's layers, each row's inputs its own prompt's.

    Args:
        model: the vision model.
        rows: per row of the batch, in order, its prompt bound to its images, or None for a
            text prompt (plain embeddings, positions from its offset).
    """

    def __init__(self, model: VisionLanguageModel, rows: Sequence[ImagePrompt | None]):
        self.model = model
        self._rows = [model if row is None else row for row in rows]

    @property
    def layers(self) -> list[nn.Module]:
        return self.model.layers

    def __call__(self, inputs: mx.array, cache: Sequence[Any]) -> mx.array:
        """Logits for ids `inputs` (B, L), row b fed after what row b of `cache` holds (its
        padding past its own ids included: the batch rolls it out afterwards)."""
        offsets = _row_offsets(cache, inputs.shape[0])
        rows = [
            row.row_inputs(inputs[b : b + 1], offset)
            for b, (row, offset) in enumerate(zip(self._rows, offsets, strict=True))
        ]
        embeds = mx.concatenate([row.embeds for row in rows], axis=0)
        positions = None
        if rows[0].positions is not None:
            positions = mx.concatenate([row.positions for row in rows], axis=1)
        return self.model.run(embeds, inputs, cache, positions, _stacked_deepstack(rows))


def _row_offsets(cache: Sequence[Any], num_rows: int) -> list[int]:
    """Each row's tokens in the batched layers (an mx.array per row; an int for one row)."""
    offset = cache[0].offset
    if isinstance(offset, mx.array):
        return [int(x) for x in offset.reshape(-1).tolist()]
    return [int(offset)] * num_rows


def _stacked_deepstack(rows: list[RowInputs]) -> Deepstack | None:
    """The rows' deepstack rows as mlx-vlm's Qwen3-VL reads a batch's: a (B, L) mask, and per
    level the rows' image tokens in row order (rows feeding none: a mask row of False)."""
    fed = [row.deep for row in rows if row.deep is not None]
    if not fed:
        return None
    length = rows[0].embeds.shape[1]
    masks = [mx.zeros((1, length), dtype=mx.bool_) if r.deep is None else r.deep.mask for r in rows]
    levels = range(len(fed[0].rows))
    per_level = [mx.concatenate([deep.rows[level] for deep in fed], axis=0) for level in levels]
    return Deepstack(mx.concatenate(masks, axis=0), per_level)
