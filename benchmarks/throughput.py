"""Prefill and decode throughput: mlxkv's Runner vs `mlx_lm.stream_generate`, same model.

Both run with their default settings (mlxkv prefills in 512-token steps on a CPU and 2,048 on a
GPU, mlx-lm in 2,048) except speculative decoding, off on mlxkv's side as mlx-lm has none by
default, on a fresh cache each repetition, and are timed the same way from
outside: the time to the first token for prefill, the spacing of the later tokens for decode.
Each size first runs once on each side untimed: on MLX's CUDA backend the first call at a new
shape compiles kernels (on an H200, 0.17-1.0 s at 2k-32k tokens), which made one of two timed
runs 3-7x slower and the median a coin toss of which side went first. Then runs alternate in
ABBA order so that machine drift affects both alike; decode, the noisiest, gets at least 5 runs.
Prefill is also timed through mlxkv's cache alone (`make_cache` and `prefill`, no Runner:
`cache_only_tps`), so a gap to mlx-lm shows whether it lies in the model calls or in the
request around them.

`benchmarks/graph_compare.py` found the graphs MLX evaluates the same on both sides (per chunk
and per decode step: the same ops, K/V concatenations and slice updates, peak memory within
3%); what differs is where and how they run. `breakdown` times each difference alone, best of
`reps`, so a GPU run names the one that costs: mlxkv's cache alone with mlx-lm's clearing of
MLX's buffer cache after every chunk (`cache_only_clear_tps`), on a stream of its own as
mlx-lm's `generation_stream` (`cache_only_stream_tps`), mlx-lm's `generate_step` on the
default stream as mlxkv runs (`mlx_lm_default_stream_tps`); for decode, mlxkv's loop
without the Runner's engine thread (`decode_loop_tps`).

`new_length_cost` asks what an agent's turn pays for its prompt's length being new: on the
H200 a turn after the first cost 60-120 ms on both servers for a few hundred new tokens, and
MLX's CUDA backend builds kernels and CUDA graphs per shape. It times the first token of
turns that add new tokens to one cached prefix, their count each time one never seen before
or always the same, alternating. A large gap would make padding a turn's tokens to a few
lengths worth trying (on a CPU there is none to find).
"""

from __future__ import annotations

import time

import mlx.core as mx
from mlx_lm import stream_generate
from mlx_lm.generate import generate_step

from benchmarks.common import Stat, token_prompt
from mlxkv import Runner
from mlxkv.cache.building import make_cache
from mlxkv.decoding import plain
from mlxkv.decoding.picker import TokenPicker
from mlxkv.decoding.prefill.chunks import PrefillPlan, prefill
from mlxkv.decoding.sampling import SamplingParams
from mlxkv.models.loading import LoadedModel


def _token_times_mlxkv(
    runner: Runner, ids: list[int], max_tokens: int, *, fresh: bool = True
) -> tuple[float, list]:
    """When each token came, from a fresh cache (else from what the Runner holds: a turn)."""
    if fresh:
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


def _cache_only_tps(runner: Runner, ids: list[int], plan: PrefillPlan | None = None) -> float:
    """Prefill tok/s through mlxkv's cache and chunking alone, on a fresh cache (with the
    Runner's plan, or `plan`)."""
    model = runner.loaded.model
    start = time.perf_counter()
    mx.eval(prefill(model, make_cache(model), ids, plan or runner.prefill_plan))
    return len(ids) / (time.perf_counter() - start)


def _mlx_lm_step_tps(loaded: LoadedModel, ids: list[int], stream: mx.Stream) -> float:
    """Prefill tok/s of mlx-lm's `generate_step` on `stream` (to its first token)."""
    start = time.perf_counter()
    for _ in generate_step(mx.array(ids), loaded.model, stream, max_tokens=1):
        break
    return len(ids) / (time.perf_counter() - start)


def breakdown(runner: Runner, loaded: LoadedModel, ids: list[int], reps: int) -> dict:
    """Prefill tok/s, best of `reps`, of each way mlxkv's run differs from mlx-lm's alone
    (see the module's docstring). No untimed run: the timed runs before compiled these
    shapes' kernels (a stream or a clear changes no kernel)."""
    plan = runner.prefill_plan
    own_stream = mx.new_stream(mx.default_device())

    def on_own_stream() -> float:
        with mx.stream(own_stream):
            return _cache_only_tps(runner, ids)

    variants = {
        "cache_only_clear_tps": lambda: _cache_only_tps(
            runner, ids, PrefillPlan(plan.step_tokens, plan.lanes, kept_buffers_bytes=0)
        ),
        "cache_only_stream_tps": on_own_stream,
        "mlx_lm_default_stream_tps": lambda: _mlx_lm_step_tps(
            loaded, ids, mx.default_stream(mx.default_device())
        ),
    }
    found = {}
    for name, run in variants.items():
        found[name] = max(run() for _ in range(reps))
    return found


def _decode_loop_tps(runner: Runner, ids: list[int], max_tokens: int) -> float:
    """Decode tok/s of mlxkv's loop (`decode_tokens`, greedy as the Runner picks) on a fresh
    cache, on the calling thread: the Runner without its engine thread and request path."""
    model = runner.loaded.model
    cache = make_cache(model)
    logits = prefill(model, cache, ids, runner.prefill_plan)
    sampling = SamplingParams(temperature=0.0).make_sampling(runner.loaded.vocab_size)
    pick = TokenPicker(sampling.sampler, [], ids, greedy=True)
    tokens = plain.decode_tokens(model, cache, logits, pick, max_tokens)
    times = [time.perf_counter() for _ in tokens]
    return (len(times) - 1) / (times[-1] - times[0])


def new_length_cost(runner: Runner, prefix: list[int], turns: int = 6) -> dict:
    """First-token seconds of turns adding tokens to the cached `prefix`, their count new
    each turn (`new_s`: 200 + i) or the same each turn (`seen_s`: 200, other ids), in turns."""
    runner.reset()
    vocab = runner.loaded.vocab_size

    def first_token_s(extra: int, seed: int) -> float:
        ids = prefix + [(seed * 7919 + i * 31) % vocab for i in range(extra)]
        start, times = _token_times_mlxkv(runner, ids, 1, fresh=False)
        return times[0] - start

    first_token_s(200, seed=0)  # the prefix cached, the seen length compiled
    new, seen = [], []
    for turn in range(1, turns + 1):
        new.append(first_token_s(200 + turn, seed=2 * turn))
        seen.append(first_token_s(200, seed=2 * turn + 1))
    return {"new_s": Stat.of(new), "seen_s": Stat.of(seen), "prefix_tokens": len(prefix)}


def measure(loaded: LoadedModel, prefill_sizes: list[int], decode_tokens: int, reps: int) -> dict:
    """Returns {"prefill": {n: {...}}, "decode": {...}} with tokens/s Stats and ratios."""
    # Plain decoding on both sides: the Runner's default ("auto") drafts on these repeating
    # greedy replies, which would measure speculation (benchmarks.speculative) instead.
    runner = Runner(loaded, speculative=None)
    results: dict = {"prefill": {}, "decode": {}}

    def prefill_tps(run, ids):
        start, times = run(ids, 1)
        return len(ids) / (times[0] - start)

    def decode_tps(run, ids):
        _, times = run(ids, decode_tokens)
        return (len(times) - 1) / (times[-1] - times[0])

    ours = lambda ids, n: _token_times_mlxkv(runner, ids, n)  # noqa: E731
    theirs = lambda ids, n: _token_times_mlx_lm(loaded, ids, n)  # noqa: E731
    for n in prefill_sizes:
        ids = token_prompt(loaded, n, seed=n)
        _warm(ours, theirs, ids, 1)
        results["prefill"][n] = _abba(
            ours, theirs, lambda run, ids=ids: prefill_tps(run, ids), reps
        )
        results["prefill"][n]["cache_only_tps"] = Stat.of(
            [_cache_only_tps(runner, ids) for _ in range(reps)]
        )
        # best of 2: about 5 s per dtype on an H200 at 2k-32k, inside the throughput share
        results["prefill"][n]["breakdown"] = breakdown(runner, loaded, ids, min(reps, 2))
    results["new_length"] = new_length_cost(runner, token_prompt(loaded, min(prefill_sizes), 1))
    ids = token_prompt(loaded, 64, seed=7)
    _warm(ours, theirs, ids, decode_tokens)
    results["decode"] = _abba(ours, theirs, lambda run: decode_tps(run, ids), max(reps, 5))
    results["decode"]["tokens"] = decode_tokens
    results["decode"]["decode_loop_tps"] = Stat.of(
        [_decode_loop_tps(runner, ids, decode_tokens) for _ in range(max(reps, 3))]
    )
    return results


def _warm(ours, theirs, ids: list[int], max_tokens: int) -> None:
    """One untimed run of each at this shape (its kernels compiled before any timed run)."""
    for run in (ours, theirs):
        run(ids, max_tokens)


def _abba(ours, theirs, measure_one, reps: int) -> dict:
    """`reps` measurements of each, in ABBA order."""
    mine, other = [], []
    for rep in range(reps):
        order = ((ours, mine), (theirs, other))
        for run, samples in order if rep % 2 == 0 else reversed(order):
            samples.append(measure_one(run))
    return _pair(mine, other)


def _pair(ours: list[float], theirs: list[float]) -> dict:
    a, b = Stat.of(ours), Stat.of(theirs)
    return {"mlxkv_tps": a, "mlx_lm_tps": b, "ratio": a.median / b.median}
