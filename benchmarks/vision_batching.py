"""Concurrent streams on a vision model, each about an image of its own, in process:
`Runner.stream(..., batched=True)` from N threads at once, this tree against another checkout
(`git worktree add /tmp/before <rev>`).

A random-weight Qwen2-VL of the factory (`mlxkv.testing.vision_factory`), "tiny" (2 text
layers of width 64) or "small" (8 layers of width 512); each stream asks about its own random
image (the sides alternate, so rows have other image token counts and M-RoPE shifts), greedy.
Per tree and load: the aggregate generated tokens/s of N concurrent streams, from the moment
they start to the last token (prefill included: a round's prompts differ after the image, so
each round prefills its question and decodes from there; the images' encoder outputs and K/V
are reused after the first, unmeasured round). Each tree runs in a child process with
PYTHONPATH set to it; the trees take turns, per round.

    python -m benchmarks.vision_batching [--size tiny] [--tokens 64] [--rounds 3]
        --baseline /tmp/before
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
IMAGE_SIDES_PIXELS = {"tiny": (56, 112), "small": (224, 168)}


def _conversation(stream: int, round_index: int, side: int) -> list[dict]:
    from mlxkv.testing.vision_factory import noise_image

    image = noise_image(stream, (side, side, 3))
    question = f"Round {round_index}: describe picture {stream} in detail, please."
    content = [{"type": "image", "image": image}, {"type": "text", "text": question}]
    return [{"role": "user", "content": content}]


def _round(runner, streams: int, round_index: int, tokens: int, sides) -> float:
    """Generated tokens/s of `streams` concurrent batched streams."""
    conversations = [_conversation(i, round_index, sides[i % len(sides)]) for i in range(streams)]
    counts = [0] * streams

    def run(i: int) -> None:
        stream = runner.stream(conversations[i], batched=True, max_tokens=tokens, temperature=0)
        counts[i] = sum(1 for chunk in stream if chunk.token is not None)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts) / (time.perf_counter() - start)


def child(model_dir: str, size: str, tokens: int, round_index: int) -> dict:
    """One round of every load on a Runner of the tree on `PYTHONPATH` (the first round
    of each load, unmeasured, encodes the images)."""
    import mlxkv
    from mlxkv import Runner

    runner = Runner.load(model_dir, max_batch=max(LOADS), cache_entries=16)
    sides = IMAGE_SIDES_PIXELS[size]
    result = {"mlxkv": str(Path(mlxkv.__file__).parent.parent)}
    for streams in LOADS:
        _round(runner, streams, -1, tokens, sides)
        result[str(streams)] = _round(runner, streams, round_index, tokens, sides)
    runner.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", choices=sorted(IMAGE_SIDES_PIXELS))
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", help="root of the checkout to compare with (required)")
    parser.add_argument("--child", nargs=3, metavar=("MODEL_DIR", "ROUND", "OUT"))
    args = parser.parse_args()
    if args.child:
        model_dir, round_index, out = args.child
        result = child(model_dir, args.size, args.tokens, int(round_index))
        Path(out).write_text(json.dumps(result))
        return
    if args.baseline is None:
        parser.error("--baseline is required: the root of another checkout to compare with")
    from mlxkv.testing.vision_factory import build_vision_model

    here = str(Path(__file__).resolve().parent.parent)
    trees = {"before": str(Path(args.baseline).resolve()), "after": here}
    results: dict[str, list[dict]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = build_vision_model(Path(scratch) / "model", family="qwen2_vl", size=args.size)
        for round_index in range(args.rounds):
            order = list(trees) if round_index % 2 == 0 else list(reversed(trees))
            for name in order:
                out = Path(scratch) / f"{name}-{round_index}.json"
                env = {**os.environ, "PYTHONPATH": trees[name]}
                command = [sys.executable, __file__, "--size", args.size]
                command += ["--tokens", str(args.tokens)]
                command += ["--child", str(model_dir), str(round_index), str(out)]
                subprocess.run(command, env=env, check=True)
                results[name].append(json.loads(out.read_text()))
    print(f"Qwen2-VL {args.size}, {args.tokens} tokens per stream, {args.rounds} rounds")
    print("| tree | mlxkv from | " + " | ".join(f"{n} streams, tok/s" for n in LOADS) + " |")
    print("|---|---|" + "---|" * len(LOADS))
    for name, rounds in results.items():
        cells = []
        for streams in LOADS:
            values = [r[str(streams)] for r in rounds]
            cells.append(f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})")
        print(f"| {name} | {rounds[0]['mlxkv']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
