"""Several requests' prompts fed in one batched forward pass, each into its own cache.

Why: on a CPU a short prompt's prefill is small matmuls and, for its last token, a one-row
pass that reads every weight. Seven 19-token prompts (after a shared 27-token prefix) took
1.45 s fed one after the other and 0.56 s together (SmolLM2 float32, this repository's 2-core
CPU). Prompts prefilled together also start decoding in the same batched step, so their
streams end together instead of leaving a tail of steps with fewer rows.

How, as mlx-lm's `BatchGenerator` prefills: the caches' layers become left-padded rows
(`BatchedKV.merged`); every prompt but its last token is fed at once, right-padded to the
longest, and the padding rolled to the left (`finalize`; recurrent layers read the rows'
`lengths` instead, where the model does); then the last tokens go as one (B, 1) step for the
logits. Each row is copied back into its cache with the tokens it was fed. A cache changes
only once the whole pass has succeeded, so a failure leaves every one as it was.

Layers that cannot trim back (sliding windows, recurrent state) take snapshots where a plain
prefill takes them: a row's checkpoints (where its reply starts) and the disk tier's block
boundaries. The pass then stops at each: it runs in stages, each feeding every row up to its
next stop (a row with none left feeds nothing: all padding), and the row's snapshot is sliced
from the batch there (`BatchedKV.snapshot`), so that each cache ends as a plain prefill leaves
it, checkpoints included.

Batched kernels round differently from one row's: K/V and logits agree with a prompt fed
alone to within float rounding (`tests/tolerances.py`), as batched decoding's do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxkv.cache.batched import BatchedKV, can_prefill_together
from mlxkv.cache.checkpoints import add_checkpoint
from mlxkv.cache.layer_ops import arrays_of
from mlxkv.cache.model_cache import ModelCache


def prefill_together(
    model: nn.Module,
    caches: Sequence[ModelCache],
    prompts: Sequence[Sequence[int]],
    *,
    stops: Sequence[Stops] | None = None,
    padded_state_exact: bool = False,
) -> list[mx.array]:
    """Feeds `prompts[i]` after what `caches[i]` holds, all rows in one batched pass.

    Args:
        stops: per row, where into its prompt its layers that cannot trim back are
            snapshotted (None: nowhere).
        padded_state_exact: the model reads `ArraysCache.lengths` (see
            `cache.batched.can_prefill_together`).

    Returns:
        Each prompt's last-token logits, shape (1, vocab), evaluated.

    Raises:
        ValueError: a prompt is empty, or a cache cannot take part
            (`cache.batched.can_prefill_together`).
    """
    if len(caches) != len(prompts) or not all(prompts):
        raise ValueError("prefill_together takes one non-empty prompt per cache")
    if not all(can_prefill_together(c, padded_state_exact=padded_state_exact) for c in caches):
        raise ValueError(
            "prefill_together takes caches of float KVCache or sliding-window layers (or "
            "recurrent state where the model reads its lengths) only"
        )
    stops = [Stops() for _ in prompts] if stops is None else stops
    batched = BatchedKV.merged(caches)
    snapshots = _staged(model, batched, caches, prompts, stops)
    last = mx.array([[prompt[-1]] for prompt in prompts], dtype=mx.uint32)  # (B, 1)
    logits = model(last, cache=batched.layers)[:, -1, :]
    rows = batched.split([cache.layers for cache in caches])
    mx.eval(logits, [a for layers in rows for layer in layers for a in arrays_of(layer)])
    for cache, layers, prompt, stop, taken in zip(
        caches, rows, prompts, stops, snapshots, strict=True
    ):
        _adopt(cache, layers, list(prompt), stop, taken)
    return [logits[row : row + 1] for row in range(len(prompts))]


@dataclass(frozen=True)
class Stops:
    """Where into a row's prompt (tokens, ascending, each within it) its layers that cannot
    trim back are snapshotted: `checkpoints` (`ModelCache.checkpoint`) and `disk` (the disk
    tier's block boundaries, `ModelCache.snapshot_for_disk`)."""

    checkpoints: tuple[int, ...] = ()
    disk: tuple[int, ...] = ()

    def points(self, prompt_tokens: int) -> list[int]:
        """The stages' ends for a prompt of `prompt_tokens`: the snapshots, then all but the
        last token (which the (B, 1) step feeds)."""
        return sorted({*self.checkpoints, *self.disk, prompt_tokens - 1} - {0})


def _staged(
    model: nn.Module,
    batched: BatchedKV,
    caches: Sequence[ModelCache],
    prompts: Sequence[Sequence[int]],
    stops: Sequence[Stops],
) -> list[dict[int, list[Any]]]:
    """Feeds every prompt but its last token into `batched`, stage by stage (see the module
    docstring); returns each row's snapshots by tokens into its prompt."""
    points = [stop.points(len(prompt)) for stop, prompt in zip(stops, prompts, strict=True)]
    fed = [0] * len(prompts)
    snapshots: list[dict[int, list[Any]]] = [{} for _ in prompts]
    for stage in range(max(map(len, points))):
        ends = [row[min(stage, len(row) - 1)] if row else 0 for row in points]
        _feed_padded(model, batched, [p[a:b] for p, a, b in zip(prompts, fed, ends, strict=True)])
        fed = ends
        for row, end in enumerate(ends):
            if end not in snapshots[row] and end in {*stops[row].checkpoints, *stops[row].disk}:
                snapshots[row][end] = batched.snapshot(row, caches[row].layers)
                # now: later steps write the batch's buffers in place, which a lazy slice reads
                mx.eval([a for layer in snapshots[row][end] if layer for a in arrays_of(layer)])
    return snapshots


def _feed_padded(model: nn.Module, batched: BatchedKV, segments: list[Sequence[int]]) -> None:
    """Feeds each row its `segments[row]` in one pass, right-padded to the longest (an empty
    segment: all padding), the padding rolled out afterwards."""
    lengths = [len(segment) for segment in segments]
    width = max(lengths)
    if width == 0:
        return
    if width == 1:
        # a (B, 1) input is a decode step to a sliding window (mlx-lm's
        # `BatchRotatingKVCache`), which takes no right padding, and after which its next
        # multi-token pass misplaces rows: feed two wide instead (every row padded)
        width = 2
    padding = [width - length for length in lengths]
    inputs = mx.array(
        [[*segment, *[0] * pad] for segment, pad in zip(segments, padding, strict=True)],
        dtype=mx.uint32,
    )  # (B, width)
    if max(padding) > 0:
        for layer in batched.layers:
            layer.prepare(lengths=lengths, right_padding=padding)
    model(inputs, cache=batched.layers)  # its logits are never evaluated: only the layers
    if max(padding) > 0:
        for layer in batched.layers:
            layer.finalize()


def _adopt(
    cache: ModelCache, layers: list[Any], prompt: list[int], stops: Stops, taken: dict
) -> None:
    """`cache` holding `layers` after its `prompt`, with the checkpoints and disk snapshots
    `taken` (by tokens into the prompt) where a plain prefill takes them."""
    start = cache.num_tokens
    checkpoints, disk = cache.checkpoints, cache.disk_snapshots
    for at, snapshot in sorted(taken.items()):
        if at in stops.checkpoints and cache.needs_checkpoints:
            add_checkpoint(checkpoints, start + at, snapshot)
        if at in stops.disk:
            disk[start + at] = snapshot  # shared with a checkpoint there, as `forward` does
    cache.adopt(layers, cache.tokens + prompt, checkpoints, disk)
    every = cache.snapshot_every_tokens
    if every and cache.num_tokens % every == 0:  # as `forward` ending on a block boundary
        cache.snapshot_for_disk()
