"""A restart whose prompt goes past what the disk holds: the blocks loaded streamed (each layer
handed to the prefill of the rest once its sections pass their checks) against checked whole
first, side by side (docs/disk.md, "Streamed restores").

    python -m benchmarks.disk_stream [--sizes 8192 32768] [--tail 2048] [--reps 1]

On `benchmarks.disk_tier.long_model` (SmolLM2-135M's shape, a 40,960-token window): the
directory holds random K/V blocks for the first `size` tokens (as a killed process leaves
them); each run copies it afresh (a run's own write-behind would store the tail), builds a
Runner (not timed) and times its first token of the prompt plus `tail` new tokens: the
restore and the tail's prefill. Runs alternate which mode goes first.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import Stat, token_prompt
from benchmarks.disk_tier import _random_kv_store, long_model
from mlxkv import Runner
from mlxkv.models.loading import LoadedModel

MODES = {"streamed": True, "checked whole first": False}


def restart_seconds(
    loaded: LoadedModel, num_tokens: int, tail_tokens: int, reps: int, work_dir: Path
) -> dict[str, Stat | int]:
    """Seconds to the first token after `num_tokens` stored plus `tail_tokens` new, per
    mode, and the tokens each run reused."""
    prompt = token_prompt(loaded, num_tokens)
    follow_up = prompt + token_prompt(loaded, tail_tokens, seed=7)
    stored = work_dir / f"stored-{num_tokens}"
    _random_kv_store(loaded, np.asarray(prompt, dtype=np.uint32), str(stored)).close()
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    cached = set()
    for rep in range(reps):
        for mode in sorted(MODES, reverse=bool(rep % 2)):
            run_dir = work_dir / "run"
            shutil.rmtree(run_dir, ignore_errors=True)
            shutil.copytree(stored, run_dir)
            runner = Runner(loaded, cache_dir=run_dir, max_context=len(follow_up) + 64)
            runner._pool.store.streamed = MODES[mode]
            start = time.perf_counter()
            cached.add(runner.generate(follow_up, max_tokens=1).cached_tokens)
            seconds[mode].append(time.perf_counter() - start)
            runner.close()
    return {**{mode: Stat.of(values) for mode, values in seconds.items()}, "cached": cached}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--tail", type=int, default=2048, help="new tokens after the stored")
    parser.add_argument("--reps", type=int, default=1)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as work_dir:
        model = long_model(Path(work_dir), 40960)
        print(f"| stored tokens | tail | {' s | '.join(MODES)} s | streamed / whole | cached |")
        print("|---|---|---|---|---|---|")
        for size in args.sizes:
            got = restart_seconds(model, size, args.tail, args.reps, Path(work_dir))
            streamed, whole = (got[mode] for mode in MODES)
            print(f"| {size} | {args.tail} | {streamed} | {whole} | "
                  f"{streamed.median / whole.median:.3f} | {sorted(got['cached'])} |",
                  flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
