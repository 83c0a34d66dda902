"""State-layer snapshots at disk block boundaries, on against off, side by side (docs/disk.md,
"Snapshots at block boundaries").

    python -m benchmarks.disk_snapshots [--first-tokens 2048] [--turns 4] [--turn-tokens 256]
                                        [--reps 3] [--models lfm2 qwen3_next-large-state]

For the tiny LFM2 (short convolutions: every boundary), a qwen3_next of large delta-rule
state (`QWEN3_NEXT_LARGE_STATE`: every k-th boundary) and, with `--models lfm2-100m`, LFM2's
layout at about 100M parameters (whose prefill is compute, not per-call overheads), each
repetition runs one conversation (a first prompt of `first-tokens` token ids, then `turns` - 1
of `turn-tokens` new ids each, 32-token replies) on a fresh Runner with a disk tier, snapshots
on, and one with them off (the interval set to None: the stops before this change only),
alternating which goes first; then new Runners on each directory answer two prompts that
diverge: one sharing the first 70% of the first prompt (a second conversation over a long
system prompt), one sharing the first 70% of the whole conversation (an edited earlier turn).
Reported: the bytes of arrays written per conversation, the turns' prefill (their times to
first token, summed: the chunk splits and the snapshots; the write is behind, not timed) with
a Runner without a disk tier beside, and the tokens each divergent prompt reused.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.common import Stat
from mlxkv import Runner
from mlxkv.models.loading import LoadedModel, load_model
from mlxkv.testing.factory import build_model
from mlxkv.testing.tiny_recurrent import QWEN3_NEXT_LARGE_STATE

_LFM2_100M_LAYERS = ["conv", "conv", "full_attention"] * 4
MODELS = {
    "lfm2": ("lfm2", None),
    "qwen3_next-large-state": ("qwen3_next", QWEN3_NEXT_LARGE_STATE),
    # LFM2's layout at about 100M parameters (hidden 768, 12 layers, one in three attention):
    # compute, not per-call overheads, dominates its prefill, as in a real model
    "lfm2-100m": (
        "lfm2",
        {
            "hidden_size": 768,
            "intermediate_size": 3072,
            "num_attention_heads": 12,
            "num_key_value_heads": 4,
            "num_hidden_layers": len(_LFM2_100M_LAYERS),
            "layer_types": _LFM2_100M_LAYERS,
            "full_attn_idxs": [i for i, t in enumerate(_LFM2_100M_LAYERS) if t != "conv"],
        },
    ),
}
MODES = ("on", "off")
REPLY_TOKENS = 32


def _ids(seed: int, count: int, vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(10, vocab - 10, count)]


def conversation(
    loaded: LoadedModel, mode: str | None, cache_dir: Path | None, sizes: list[int]
) -> tuple[int, float, list[int]]:
    """One conversation on a fresh Runner, its turns' prompts adding `sizes` new tokens each:
    (bytes of arrays written, the turns' seconds to
    their first tokens, summed, the tokens the conversation holds at its end)."""
    written = [0]
    runner = Runner(loaded, cache_dir=cache_dir, speculative=None)
    store = runner._pool.store
    if store is not None:
        run = store._run

        def counted(job, _run=run):
            written[0] += sum(a.nbytes for a in job.arrays.values())
            _run(job)

        store._run = counted
        if mode == "off":
            store.snapshot_every_tokens = None
    prompt: list[int] = []
    prefill_s = 0.0
    for turn, size in enumerate(sizes):
        prompt = prompt + _ids(100 + turn, size, loaded.vocab_size)
        out = runner.generate(prompt, max_tokens=REPLY_TOKENS, temperature=0)
        prefill_s += out.ttft
        prompt = prompt + out.tokens
    runner.close()
    return written[0], prefill_s, prompt


def _cpu() -> str:
    try:  # Linux names the model here; platform.processor() is empty there
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info if "model name" in line)
    except (OSError, StopIteration):
        return f"{platform.machine()} {platform.processor()}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--first-tokens", type=int, default=2048)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS)[:2])
    args = parser.parse_args(argv)
    sizes = [args.first_tokens] + [args.turn_tokens] * (args.turns - 1)
    print(f"# {_cpu()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    print(
        "| model | snapshots every | mode | written per conversation | prefill s (all turns) "
        "| no disk tier s | reused: 70% of the first prompt | 70% of the conversation |"
    )
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as work:
        for name in args.models:
            arch, overrides = MODELS[name]
            loaded = load_model(build_model(arch, Path(work) / arch, config_overrides=overrides))
            written, first, plain, reused = {m: [] for m in MODES}, {m: [] for m in MODES}, [], {}
            every = None
            for rep in range(args.reps):
                for mode in MODES[:: 1 if rep % 2 == 0 else -1]:
                    cache_dir = Path(work) / f"{arch}-{mode}-{rep}"
                    nbytes, seconds, held = conversation(loaded, mode, cache_dir, sizes)
                    written[mode].append(nbytes)
                    first[mode].append(seconds)
                    reused[mode] = []
                    for shared in (int(sizes[0] * 0.7), int(len(held) * 0.7)):
                        prompt = held[:shared] + _ids(7, 64, loaded.vocab_size)
                        restarted = Runner(loaded, cache_dir=cache_dir, speculative=None)
                        every = every or restarted._pool.store.snapshot_every_tokens
                        out = restarted.generate(prompt, max_tokens=1, temperature=0)
                        reused[mode].append(f"{out.cached_tokens} of {shared}")
                        restarted.close()
                plain.append(conversation(loaded, None, None, sizes)[1])
            for mode in MODES:
                mib = Stat.of([b / 2**20 for b in written[mode]])
                print(f"| {name} | {every} tokens | {mode} | {mib} MiB | {Stat.of(first[mode])} "
                      f"| {Stat.of(plain)} | {' | '.join(reused[mode])} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
