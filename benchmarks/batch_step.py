"""Host time per batched decode step: mlxkv's batched streams against mlx-lm's `BatchGenerator`,
in process, on a model whose compute costs next to nothing (the factory's tiny llama: 2 layers
of 64), so that what is measured is the Python around each step.

Per side and rows (B = 1, 4, 8), greedy, `--tokens` tokens a row, distinct prompts:
  - mlxkv: B threads each reading `Runner.stream(..., batched=True)` (the server's path, less
    HTTP): the median time between two tokens of one stream, once every row decodes;
  - mlx-lm: `BatchGenerator.next_generated()` in a loop: the median time of one call;
  - the model alone: one pipelined forward pass of B rows with argmax (`batching.ceiling`'s
    loop), what neither side can go under.
Each (side, B) runs `--rounds` times, the sides in turns; medians over rounds are printed.

    python -m benchmarks.batch_step [--tokens 96] [--rounds 3] [--size tiny]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import mlx.core as mx

from mlxkv import Runner
from mlxkv.testing.factory import build_model

LOADS = (1, 4, 8)
PROMPT_TOKENS = 24


def _prompts(rows: int, offset: int) -> list[list[int]]:
    """Distinct token-id prompts (no shared cache between rows or rounds)."""
    return [
        [(offset * 131 + row * 17 + i * 7) % 400 + 10 for i in range(PROMPT_TOKENS)]
        for row in range(rows)
    ]


def mlxkv_step(runner: Runner, prompts: list[list[int]], tokens: int) -> tuple[float, ...]:
    """(wall, process CPU, driving thread's CPU) seconds per step of `len(prompts)` batched
    streams of `tokens` tokens, from the streams' start to their end (their short prefills
    included). The driving thread is the engine's, which runs every step and every stream's
    text (the readers only hand chunks on)."""
    engine = runner._engine  # a benchmark's look inside: the thread the steps run on
    start = threading.Barrier(len(prompts) + 1)

    def read(i: int) -> None:
        start.wait()
        for _ in runner.stream(prompts[i], max_tokens=tokens, temperature=0, batched=True):
            pass

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    own = engine.call(time.thread_time)
    start.wait()
    wall, cpu = time.perf_counter(), time.process_time()
    for thread in threads:
        thread.join()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return wall / tokens, cpu / tokens, (engine.call(time.thread_time) - own) / tokens


def mlx_lm_step(model, prompts: list[list[int]], tokens: int) -> tuple[float, ...]:
    """The same for a `BatchGenerator` driven by this thread."""
    from mlx_lm.generate import BatchGenerator

    wall, cpu, own = time.perf_counter(), time.process_time(), time.thread_time()
    generator = BatchGenerator(model, max_tokens=tokens, stop_tokens=[])
    generator.insert(prompts, [tokens] * len(prompts))
    while generator.next_generated():
        pass
    wall, cpu, own = (
        time.perf_counter() - wall,
        time.process_time() - cpu,
        time.thread_time() - own,
    )
    return wall / tokens, cpu / tokens, own / tokens


def model_step(model, rows: int, steps: int) -> tuple[float, ...]:
    """The same for a pipelined forward pass of `rows` rows with argmax, nothing else."""
    from mlx_lm.models.cache import BatchKVCache

    cache = [BatchKVCache([0] * rows) for _ in model.layers]
    mx.eval(model(mx.ones((rows, PROMPT_TOKENS), dtype=mx.uint32), cache=cache))

    def step(tokens):
        picked = mx.argmax(model(tokens, cache=cache)[:, -1, :], axis=-1)[:, None]
        mx.async_eval(picked)
        return picked

    tokens = step(mx.ones((rows, 1), dtype=mx.uint32))
    wall, cpu, own = time.perf_counter(), time.process_time(), time.thread_time()
    for _ in range(steps):
        following = step(tokens)
        tokens.tolist()
        tokens = following
    wall, cpu, own = (
        time.perf_counter() - wall,
        time.process_time() - cpu,
        time.thread_time() - own,
    )
    return wall / steps, cpu / steps, own / steps


def _three(ms: list[float]) -> str:
    return " / ".join(f"{value:.2f}" for value in ms)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", default="tiny", choices=["tiny", "100m"])
    args = parser.parse_args(argv)
    from mlx_lm import load

    sides = ("mlxkv", "mlx_lm", "model")
    results: dict[tuple[str, int], list[tuple[float, ...]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model("llama", Path(tmp) / "llama", size=args.size)
        runner = Runner.load(str(path), max_batch=max(LOADS), cache_entries=64)
        model, _ = load(str(path))
        for rows in LOADS:
            for n in range(args.rounds + 1):  # the first round warms each shape up, untimed
                prompts = _prompts(rows, rows * 100 + n)
                measured = {
                    "mlxkv": mlxkv_step(runner, prompts, args.tokens),
                    "mlx_lm": mlx_lm_step(model, prompts, args.tokens),
                    "model": model_step(model, rows, args.tokens),
                }
                for side in sides if n else ():
                    results.setdefault((side, rows), []).append(measured[side])
        runner.close()
    print(f"ms per batched decode step, llama {args.size}, {args.tokens} tokens a row, medians")
    print("wall / process CPU / CPU of the thread that runs the steps")
    print("| rows | mlxkv | mlx-lm BatchGenerator | mlxkv / mlx-lm (wall, thread) | model alone |")
    print("|---|---|---|---|---|")
    for rows in LOADS:
        ms = {
            side: [statistics.median(r[k] for r in results[side, rows]) * 1e3 for k in (0, 1, 2)]
            for side in sides
        }
        ours, theirs = ms["mlxkv"], ms["mlx_lm"]
        print(
            f"| {rows} | {_three(ours)} | {_three(theirs)} "
            f"| {ours[0] / theirs[0]:.2f}x, {ours[2] / theirs[2]:.2f}x | {_three(ms['model'])} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
