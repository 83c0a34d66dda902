"""Batched streams on models whose caches hold sliding windows, recurrent state or quantized
K/V, this tree against another (the commit before they batched), side by side in one run.

Per tree and model (the factory's LFM2 and Gemma 3 at `--size`, Gemma 3's window set to
`WINDOW_TOKENS` so that it wraps within a stream; its llama with K/V quantized to 8 bits,
`llama-q8`), in process: N threads each reading
`Runner.stream(..., batched=True)` (the server's path, less HTTP), greedy, no speculation,
`--tokens` tokens a stream, distinct prompts; the aggregate generated tokens/s from the
streams' start to their end (prefills included), for N = 1 and 4, and the time from their
start until every stream has its first token (the prompts prefilled, together where the
tree's `PrefillGroup` admits them). Each (tree, model) runs in a
process of its own with that tree first on `PYTHONPATH`, `--rounds` times, the trees in turns;
medians over rounds are printed.

    python -m benchmarks.layer_kinds --before DIR [--tokens 64] [--rounds 3] [--size 100m]
        [--models lfm2,gemma3_text,llama-q8]

`DIR` holds the other tree's `mlxkv/` (e.g. `git archive HEAD~3 mlxkv | tar -x -C DIR`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

LOADS = (1, 4)
PROMPT_TOKENS = 24
WINDOW_TOKENS = 64
# LFM2 as the real ones are laid out: mostly short convolutions, every 3rd layer attention
# (a 12-layer "100m"; its config names each layer's kind)
_LFM2_LAYERS = ["conv", "conv", "full_attention"] * 4
# name -> (factory architecture, its config changes, the Runner's settings)
MODELS = {
    "lfm2": (
        "lfm2",
        {
            "layer_types": _LFM2_LAYERS,
            "full_attn_idxs": [i for i, kind in enumerate(_LFM2_LAYERS) if kind != "conv"],
        },
        {},
    ),
    "gemma3_text": ("gemma3_text", {"sliding_window": WINDOW_TOKENS}, {}),
    "llama-q8": ("llama", {}, {"kv_bits": 8}),
}


def _measure(model_dir: str, tokens: int, settings: dict) -> dict[str, dict[int, float]]:
    """Per N: aggregate tokens/s of N batched streams ("rates") and seconds until every
    stream had its first token ("first_s"), run in the tree under test."""
    from mlxkv import Runner

    runner = Runner.load(model_dir, max_context=1024, cache_entries=8, max_batch=4, **settings)
    rates, firsts = {}, {}
    for offset, rows in enumerate(LOADS):
        prompts = [
            [(offset * 131 + row * 17 + i * 7) % 400 + 10 for i in range(PROMPT_TOKENS)]
            for row in range(rows)
        ]
        start = threading.Barrier(rows + 1)
        counts = [0] * rows
        first = [0.0] * rows

        def read(i: int, prompts=prompts, start=start, counts=counts, first=first) -> None:
            start.wait()
            options = {"max_tokens": tokens, "temperature": 0, "speculative": None}
            for chunk in runner.stream(prompts[i], batched=True, **options):
                counts[i] += chunk.token is not None
                first[i] = first[i] or time.perf_counter()

        threads = [threading.Thread(target=read, args=(i,)) for i in range(rows)]
        for thread in threads:
            thread.start()
        start.wait()
        began = time.perf_counter()
        for thread in threads:
            thread.join()
        rates[rows] = sum(counts) / (time.perf_counter() - began)
        firsts[rows] = max(first) - began
    runner.close()
    return {"rates": rates, "first_s": firsts}


def _run(tree: Path, model_dir: Path, tokens: int, settings: dict) -> dict[str, dict[int, float]]:
    env_path = f"{tree}:{Path(__file__).resolve().parent.parent}"
    measure = ["--measure", str(model_dir), "--settings", json.dumps(settings)]
    out = subprocess.run(
        [sys.executable, __file__, *measure, "--tokens", str(tokens)],
        env={**os.environ, "PYTHONPATH": env_path},
        capture_output=True,
        text=True,
        check=True,
    )
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    return {what: {int(k): v for k, v in by_rows.items()} for what, by_rows in measured.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # required, but not of the --measure runs this script starts of itself
    parser.add_argument("--before", type=Path, help="the other tree (its mlxkv/); required")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", default="100m")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--settings", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(_measure(args.measure, args.tokens, json.loads(args.settings))))
        return
    if args.before is None:
        parser.error("--before DIR is required: the tree to compare this one with")
    models = {name: MODELS[name] for name in args.models.split(",")}
    from mlxkv.testing.factory import build_model

    after = Path(__file__).resolve().parent.parent
    trees = {"before": args.before.resolve(), "after": after}
    with tempfile.TemporaryDirectory() as work:
        dirs = {
            name: build_model(arch, Path(work) / name, size=args.size, config_overrides=extra)
            for name, (arch, extra, _) in models.items()
        }
        rates: dict = {(t, m): [] for t in trees for m in models}
        for _ in range(args.rounds):
            for model, model_dir in dirs.items():
                settings = models[model][2]
                for name, tree in trees.items():
                    rates[name, model].append(_run(tree, model_dir, args.tokens, settings))
    for what, unit in (("rates", "tokens/s"), ("first_s", "s until every first token")):
        print(f"{unit}, {args.rounds} rounds (medians), {args.tokens} tokens a stream")
        print("| model | streams | before | after | after / before |")
        print("|---|---|---|---|---|")
        for model in models:
            for rows in LOADS:
                before = statistics.median(r[what][rows] for r in rates["before", model])
                now = statistics.median(r[what][rows] for r in rates["after", model])
                print(f"| {model} | {rows} | {before:.2f} | {now:.2f} | {now / before:.2f}x |")


if __name__ == "__main__":
    main()
