"""Prefill and decode throughput: mlxkv's Runner vs `mlx_lm.stream_generate`, same model.

Both run with their default settings (mlxkv prefills in 512-token steps, mlx-lm in 2048), on a
fresh cache each repetition, and are timed the same way from outside: the time to the first
token for prefill, the spacing of the later tokens for decode. Runs alternate between the two so
that machine drift affects both alike.
"""

from __future__ import annotations

import time

from mlx_lm import stream_generate

from benchmarks.common import Stat, token_prompt
from mlxkv import Runner
from mlxkv.runner.loading import LoadedModel


def _token_times_mlxkv(runner: Runner, ids: list[int], max_tokens: int) -> tuple[float, list]:
    runner.reset()
    start = time.perf_counter()
    times = [time.perf_counter() for c in runner.stream(ids, max_tokens=max_tokens) if c.token]
    return start, times


def _token_times_mlx_lm(loaded: LoadedModel, ids: list[int], max_tokens: int):
    start = time.perf_counter()
    times = [
        time.perf_counter()
        for _ in stream_generate(loaded.model, loaded.tokenizer, ids, max_tokens=max_tokens)
    ]
    return start, times


def measure(loaded: LoadedModel, prefill_sizes: list[int], decode_tokens: int, reps: int) -> dict:
    """Returns {"prefill": {n: {...}}, "decode": {...}} with tokens/s Stats and ratios."""
    runner = Runner(loaded)
    results: dict = {"prefill": {}, "decode": {}}
    for n in prefill_sizes:
        ids = token_prompt(loaded, n, seed=n)
        ours, theirs = [], []
        for _ in range(reps):
            start, times = _token_times_mlxkv(runner, ids, 1)
            ours.append(n / (times[0] - start))
            start, times = _token_times_mlx_lm(loaded, ids, 1)
            theirs.append(n / (times[0] - start))
        results["prefill"][n] = _pair(ours, theirs)
    ids = token_prompt(loaded, 64, seed=7)
    ours, theirs, counts = [], [], []
    for _ in range(reps):
        _, times = _token_times_mlxkv(runner, ids, decode_tokens)
        ours.append((len(times) - 1) / (times[-1] - times[0]))
        _, times = _token_times_mlx_lm(loaded, ids, decode_tokens)
        theirs.append((len(times) - 1) / (times[-1] - times[0]))
        counts.append(len(times))
    results["decode"] = {**_pair(ours, theirs), "tokens": min(counts)}
    return results


def _pair(ours: list[float], theirs: list[float]) -> dict:
    a, b = Stat.of(ours), Stat.of(theirs)
    return {"mlxkv_tps": a, "mlx_lm_tps": b, "ratio": a.median / b.median}
