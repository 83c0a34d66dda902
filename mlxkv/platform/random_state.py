"""MLX state that every request must leave clean.

Owns: the MLX state a request touches:
  - the random key (`mx.random.state`, one per thread): a seeded request must not leave its
    seed's sequence behind for the requests after it (their "random" text would be
    predictable); and mlx-lm's samplers are `mx.compile`d with the key as an input and an
    output, so a sampler that raises while it is traced leaves a tracer without a primitive in
    the key, and every later sampled generation fails ("Attempting to eval an array without a
    primitive") until something reseeds;
  - thread-local streams (see `mlxkv.platform.threads`, used by the disk tier's writer).

Does not own the model's or the cache's arrays (see `loading.materialize` and
`ModelCache.materialize`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

import mlx.core as mx

logger = logging.getLogger(__name__)

T = TypeVar("T")


@contextmanager
def request_random_state(seed: int | None) -> Iterator[None]:
    """The random key one request samples with: `seed`'s own sequence for a seeded request,
    after which the thread's key is put back where it was (so the seed leaves later unseeded
    sampling as unpredictable as before); for an unseeded one, the thread's key, which the
    request advances. Either way the key is left evaluated, and as it was before the block
    if the block broke it (a sampler that failed while being traced)."""
    saved = _usable_key()
    if seed is not None:
        mx.random.seed(seed)
    try:
        yield
    finally:
        try:
            mx.eval(mx.random.state)
            broken = False
        except (RuntimeError, ValueError):
            logger.warning("random state left unusable by a failed request; restored it")
            broken = True
        if broken or seed is not None:
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


def with_own_key(steps: Iterator[T], seed: int) -> Iterator[T]:
    """The items of `steps`, each computed with `seed`'s own random key swapped in and the
    thread's key put back after: a seeded request interleaved with others (a decode batch)
    draws the same sequence as alone, and theirs are unaffected. Closing this closes `steps`.
    (MLX's key can only be set by seeding: each swap reads a key back, a sync per item.)"""
    own = seed
    try:
        while True:
            saved = _usable_key()
            mx.random.seed(own)
            try:
                item = next(steps)
            except StopIteration:
                return
            finally:
                own = _usable_key()
                mx.random.seed(saved)
            yield item
    finally:
        steps.close()
