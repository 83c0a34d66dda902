"""Test helpers: K/V whose values name their positions, and tiny real models."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxkv.testing.factory import build_model

HEADS = 2
HEAD_DIM = 4


def make_kv(positions, heads: int = HEADS, head_dim: int = HEAD_DIM) -> tuple[mx.array, mx.array]:
    """Keys and values (1, heads, L, head_dim) in which every element equals its position.

    Values are the negated positions, so a mix-up of keys and values shows too.
    """
    pos = np.asarray(list(positions), dtype=np.float32)
    keys = np.broadcast_to(pos[None, None, :, None], (1, heads, len(pos), head_dim))
    return mx.array(keys), mx.array(-keys)


def positions_of(keys: mx.array) -> list[int]:
    """Reads back the positions stored in keys made by `make_kv` (first head, first dim)."""
    return [int(p) for p in np.array(keys[0, 0, :, 0])]


@cache
def tiny_model_dir(arch: str, root: str) -> Path:
    """Builds (once per session and root) the tiny factory model of `arch`."""
    return build_model(arch, Path(root) / arch)


def fail_layer_update(monkeypatch, fail_at: int, error: type[BaseException]) -> None:
    """Makes the `fail_at`-th K/V update (counting KVCache and SlidingWindowCache layers
    together) raise `error`: a fault at a chosen point inside the model."""
    from mlxkv.cache import KVCache, SlidingWindowCache

    calls = {"n": 0}
    for cls in (KVCache, SlidingWindowCache):
        real = cls.update_and_fetch

        def failing(self, keys, values, _real=real):
            calls["n"] += 1
            if calls["n"] == fail_at:
                raise error
            return _real(self, keys, values)

        monkeypatch.setattr(cls, "update_and_fetch", failing)
