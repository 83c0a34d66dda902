"""Checkpoints of a ModelCache: snapshots, by length in tokens, of the layers that cannot
trim back (recurrent state, sliding windows).

Owns how a snapshot is taken (`snapshot_layers`) and how many are kept (`add_checkpoint`,
`MAX_CHECKPOINTS`), and dropping those past a length. Does not own when one is taken or restored
(`model_cache.ModelCache.checkpoint`, `rewind_to`, `copy_prefix`), nor their bytes (`footprint`).

Invariant: a snapshot is never changed in place once taken, so caches may share it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxkv.cache.layer_ops import always_trimmable, arrays_of, copy_layer

# Snapshots of non-trimmable layers kept for rewinding: the earliest one (where a system prompt
# ends, shared by conversations) and the newest prompts' ends (this turn and a regenerated one).
# Three bound the memory while covering the usual chat.
MAX_CHECKPOINTS = 3


def add_checkpoint(checkpoints: dict[int, list[Any]], num_tokens: int, snapshot: list[Any]) -> None:
    """Adds to `checkpoints` (in place) `snapshot` (`snapshot_layers`) at `num_tokens`. Keeps the
    earliest and the newest, at most `MAX_CHECKPOINTS`."""
    checkpoints[num_tokens] = snapshot
    while len(checkpoints) > MAX_CHECKPOINTS:
        earliest = min(checkpoints)
        del checkpoints[next(n for n in checkpoints if n != earliest)]


def snapshot_layers(layers: list[Any], *, evaluate: bool = True) -> list[Any]:
    """A snapshot of `layers`: per layer a copy (evaluated unless not `evaluate`: MLX's arrays
    are values, so a lazy copy still holds the state it was taken at), or None for a layer
    that can simply trim back."""
    snapshot = [None if always_trimmable(layer) else copy_layer(layer) for layer in layers]
    if evaluate:
        mx.eval([a for saved in snapshot if saved for a in arrays_of(saved)])
    return snapshot


def drop_checkpoints_after(num_tokens: int, *checkpoints: dict[int, list[Any]]) -> None:
    """Removes, in place, the snapshots taken past `num_tokens` tokens from each dict."""
    for points in checkpoints:
        for n in [n for n in points if n > num_tokens]:
            del points[n]
