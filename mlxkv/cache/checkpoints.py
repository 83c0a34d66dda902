"""Checkpoints of a ModelCache: snapshots, by length in tokens, of the layers that cannot
trim back (recurrent state, sliding windows).

Owns how a snapshot is taken and how many are kept (`add_checkpoint`, `MAX_CHECKPOINTS`),
dropping those past a length, and listing their layers (`checkpoint_layers`). Does not own when
one is taken or restored (`model_cache.ModelCache.checkpoint`, `rewind_to`, `copy_prefix`).

Invariant: a snapshot is never changed in place once taken, so caches may share it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxkv.cache.layer_ops import always_trimmable, arrays_of, copy_layer, leaves

# Snapshots of non-trimmable layers kept for rewinding: the earliest one (where a system prompt
# ends, shared by conversations) and the newest prompts' ends (this turn and a regenerated one).
# Three bound the memory while covering the usual chat.
MAX_CHECKPOINTS = 3


def add_checkpoint(checkpoints: dict[int, list[Any]], num_tokens: int, layers: list[Any]) -> None:
    """Adds to `checkpoints` (in place) a snapshot of `layers` at `num_tokens`: per layer a
    copy, evaluated, or None for a layer that can simply trim back. Keeps the earliest and the
    newest, at most `MAX_CHECKPOINTS`."""
    snapshot = [None if always_trimmable(layer) else copy_layer(layer) for layer in layers]
    mx.eval([a for layer in leaves([s for s in snapshot if s]) for a in arrays_of(layer)])
    checkpoints[num_tokens] = snapshot
    while len(checkpoints) > MAX_CHECKPOINTS:
        earliest = min(checkpoints)
        del checkpoints[next(n for n in checkpoints if n != earliest)]


def drop_checkpoints_after(checkpoints: dict[int, list[Any]], num_tokens: int) -> None:
    """Removes, in place, the checkpoints taken past `num_tokens` tokens."""
    for n in [n for n in checkpoints if n > num_tokens]:
        del checkpoints[n]


def checkpoint_layers(cache: Any) -> list[Any]:
    """The per-layer caches of all a ModelCache's checkpoints (`CacheList`s flattened).
    Snapshots may be shared with copies of the cache: count bytes once per object."""
    # list(): a consistent view even while a generation on another thread adds one
    saved = [layer for snap in list(cache.checkpoints.values()) for layer in snap if layer]
    return leaves(saved)
