"""Cache bookkeeping at 1k / 8k / 32k tokens, in microseconds: trim, prefix match, and the
memory log call made after every generation. Uses SmolLM2-shaped K/V (30 layers, 3 KV heads,
head dim 64, float32) fed by a stand-in model, so no model compute is timed."""

from __future__ import annotations

import time

import mlx.core as mx

from benchmarks.common import Stat
from mlxkv.cache import KVCache, ModelCache
from mlxkv.runner.prompt_cache.pool import CachePool
from mlxkv.runner.prompt_cache.report import MemoryReport

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64


class _KVWriter:
    """Stands in for a model: writes K/V for the given ids into every layer."""

    def __call__(self, ids: mx.array, cache) -> mx.array:
        num = ids.shape[1]
        kv = mx.ones((1, KV_HEADS, num, HEAD_DIM))
        for layer in cache:
            layer.update_and_fetch(kv, kv)
        return mx.zeros((1, num, 1))


def _filled(num_tokens: int) -> ModelCache:
    def make_layers():
        return [KVCache() for _ in range(LAYERS)]

    cache = ModelCache(make_layers(), make_layers)
    writer = _KVWriter()
    for start in range(0, num_tokens, 4096):
        cache.feed(writer, list(range(start, min(start + 4096, num_tokens))))
    return cache


def _micros(fn, reps: int) -> Stat:
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return Stat.of(samples)


def measure(sizes: list[int], reps: int) -> dict:
    rows = {size: _measure_size(size, reps) for size in sizes}
    mx.clear_cache()
    return rows


def _measure_size(size: int, reps: int) -> dict:
    cache = _filled(size)
    pool = CachePool(lambda: cache)  # its first (missing) lookup adopts the filled cache
    pool.release(pool.fetch_nearest([0]).entry)
    extension = cache.tokens + [1, 2, 3]
    # The log call first, on the released entry as after a generation: the matches below
    # leave the entry claimed, and a report over a claimed entry costs ~100x more (2.7 ms).
    log_call_us = _micros(lambda: MemoryReport.measure(pool).log_line(), reps)
    return {
        "prefix_match_us": _match_micros(pool, extension, reps),
        "log_call_us": log_call_us,
        # Each trim drops one token: O(1) whatever the size.
        "trim_us": _micros(lambda: cache.trim_to(cache.num_tokens - 1), reps),
        "kv_bytes": cache.used_bytes,
    }


def _match_micros(pool: CachePool, tokens: list[int], reps: int) -> Stat:
    """The time of a prefix match on the released entry, as a request finds it: each match
    claims the entry, and is released (not timed) before the next, which would otherwise
    find it in use and copy it."""
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        found = pool.fetch_nearest(tokens)
        samples.append((time.perf_counter() - start) * 1e6)
        pool.release(found.entry)
    return Stat.of(samples)
