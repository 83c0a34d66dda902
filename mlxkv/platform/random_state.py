"""Process-wide MLX state that every request must leave clean, whatever thread it ran on.

Owns: the global MLX state a request touches:
  - the random key (`mx.random.state`): mlx-lm's samplers are `mx.compile`d with the key as an
    input and an output, so a sampler that raises while it is traced leaves a tracer without a
    primitive in the key, and every later sampled generation in the process fails ("Attempting
    to eval an array without a primitive") until something reseeds;
  - thread-local streams (see `mlxkv.platform.threads`, shared with the disk tier's writer).

Does not own the model's or the cache's arrays (see `loading.materialize` and
`ModelCache.materialize`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx

logger = logging.getLogger(__name__)


@contextmanager
def clean_random_state() -> Iterator[None]:
    """Leaves `mx.random.state` evaluated after the block, and as it was before the block if
    the block broke it (a sampler that failed while being traced)."""
    saved = _usable_key()
    try:
        yield
    finally:
        try:
            mx.eval(mx.random.state)
        except (RuntimeError, ValueError):
            logger.warning("random state left unusable by a failed request; restored it")
            mx.random.seed(saved)


def _usable_key() -> int:
    """The current random key as the seed that recreates it (MLX's key for seed s is
    [s >> 32, s & 0xFFFFFFFF]); reseeds first if something outside mlxkv broke the key."""
    try:
        high, low = mx.random.state[0].tolist()
    except (RuntimeError, ValueError):
        logger.warning("random state found unusable; reseeded it")
        mx.random.seed(int.from_bytes(os.urandom(8), "little"))
        high, low = mx.random.state[0].tolist()
    return (high << 32) | low
