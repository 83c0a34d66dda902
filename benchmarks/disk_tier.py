"""The disk tier, side by side in one run: a restart after `kill -9` against a cold prefill, decode
speed with each turn written behind against no disk tier, bytes on disk for conversations
sharing a long system prompt, and bytes written per token.

    python -m benchmarks.disk_tier [--sizes 1024 8192] [--model PATH] [--quick]

Targets (issue 40): restart <= 0.1x cold at 8k tokens; decode with write-behind >= 0.97x.
Prints Markdown; every timing is the median of `--reps` runs with [min-max].
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import Stat, filler_text, load_models, token_prompt
from mlxkv import Runner, format_bytes
from mlxkv.models.loading import LoadedModel, load_model

ROOT = Path(__file__).resolve().parents[1]

# A process that fills the disk tier, waits until its turn is durable, and kills itself.
_KILLED_CHILD = """
import json, os, signal, sys, time
from mlxkv import Runner
model, cache_dir, max_context, prompt = sys.argv[1] or None, sys.argv[2], int(sys.argv[3]), \
    json.loads(sys.argv[4])
runner = Runner.load(model, cache_dir=cache_dir, max_context=max_context)
runner.generate(prompt, max_tokens=4)
entry = runner._pool.latest
path = runner.cache_dir / (runner._pool.store.block_keys(entry.tokens)[-1] + ".safetensors")
deadline = time.monotonic() + 120
while not path.exists() and time.monotonic() < deadline:
    time.sleep(0.01)
print("durable" if path.exists() else "not durable", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _first_token(runner: Runner, prompt: list[int]) -> int:
    """Generates one token; returns how many prompt tokens were cached."""
    return runner.generate(prompt, max_tokens=1).cached_tokens


def restart_after_kill(
    loaded: LoadedModel, model_arg: str, num_tokens: int, reps: int
) -> dict[str, Stat | int]:
    """Seconds to the first token of a prompt whose prefix a killed process left on disk
    (a new Runner: indexing, loading, the rest), against a cold Runner's."""
    max_context = num_tokens + 64
    prompt = token_prompt(loaded, num_tokens)
    follow_up = prompt + token_prompt(loaded, 16, seed=7)
    warm, cold, cached = [], [], 0
    for _ in range(reps):
        with tempfile.TemporaryDirectory() as cache_dir:
            child = subprocess.run(
                [sys.executable, "-c", _KILLED_CHILD, model_arg, cache_dir, str(max_context),
                 json.dumps(prompt)],
                capture_output=True, text=True, cwd=ROOT, timeout=1800,
                env=dict(os.environ, PYTHONPATH=str(ROOT)),
            )  # fmt: skip
            assert "durable" in child.stdout.split(), child.stderr[-2000:]
            start = time.perf_counter()
            runner = Runner(loaded, cache_dir=cache_dir, max_context=max_context)
            cached = _first_token(runner, follow_up)
            warm.append(time.perf_counter() - start)
            runner.close()
        start = time.perf_counter()
        _first_token(Runner(loaded, max_context=max_context), follow_up)
        cold.append(time.perf_counter() - start)
    return {"warm_s": Stat.of(warm), "cold_s": Stat.of(cold), "cached_tokens": cached}


class _Writes(logging.Handler):
    """Sums the bytes of the disk tier's writes (its DEBUG line per write)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.nbytes = 0

    def emit(self, record: logging.LogRecord) -> None:
        if found := re.search(r"disk cache write tokens=\d+ bytes=(\d+)", record.getMessage()):
            self.nbytes += int(found.group(1))


def decode_with_write_behind(
    loaded: LoadedModel, system_tokens: int, turns: int, reply_tokens: int
) -> dict[str, float]:
    """Decode tokens/s of a conversation with each turn written behind, and of the same
    conversation without a disk tier, turns alternating between the two; bytes written per
    generated token, and per token the conversation holds at the end (each token's K/V
    written once would be the K/V bytes per token)."""
    writes = _Writes()
    store_logger = logging.getLogger("mlxkv.runner.disk.store")
    store_logger.addHandler(writes)
    store_logger.setLevel(logging.DEBUG)
    system = filler_text(system_tokens * 3 // 4, seed=1)
    tps: dict[str, list[float]] = {"on": [], "off": []}
    generated = 0
    with tempfile.TemporaryDirectory() as cache_dir:
        runners = {"on": Runner(loaded, cache_dir=cache_dir), "off": Runner(loaded)}
        chats = {side: [{"role": "system", "content": system}] for side in runners}
        for turn in range(turns):
            for side, runner in runners.items():
                chat = chats[side]
                chat.append({"role": "user", "content": f"Turn {turn}: {filler_text(12, turn)}"})
                out = runner.generate(chat, max_tokens=reply_tokens)
                chat.append({"role": "assistant", "content": out.text})
                tps[side].append(out.generation_tps)
                generated += out.generation_tokens if side == "on" else 0
        runners["on"].close()
        held = runners["on"]._pool.latest.num_tokens
        stored = list(runners["on"]._pool.store._records.values())
        kv_per_token = sum(r.nbytes for r in stored) / sum(r.num_tokens for r in stored)
    store_logger.removeHandler(writes)
    on, off = Stat.of(tps["on"]), Stat.of(tps["off"])
    return {"on": on, "off": off, "ratio": on.median / off.median,
            "per_generated": writes.nbytes / max(generated, 1),
            "per_held": writes.nbytes / held, "kv_per_token": kv_per_token}  # fmt: skip


def shared_prefix_bytes(loaded: LoadedModel, system_tokens: int, conversations: int) -> dict:
    """Bytes on disk for `conversations` one-turn chats over one long system prompt, against
    one copy of the prompt plus each conversation's own tail."""
    system = filler_text(system_tokens * 3 // 4, seed=2)
    with tempfile.TemporaryDirectory() as cache_dir:
        runner = Runner(loaded, cache_dir=cache_dir, cache_entries=conversations)
        for i in range(conversations):
            chat = [{"role": "system", "content": system}, {"role": "user", "content": f"Q{i}?"}]
            runner.generate(chat, max_tokens=16)
        runner._pool.store.flush()
        records = list(runner._pool.store._records.values())  # blocks
        on_disk = sum(r.nbytes for r in records)
        shared = runner.encode([{"role": "system", "content": system}])
        per_token = on_disk / sum(r.num_tokens for r in records)
        tails = sum(entry.num_tokens - len(shared) for entry in runner._pool.entries)
        runner.close()
    one_copy = int(per_token * (len(shared) + tails))
    return {"files": len(records), "on_disk": on_disk, "one_copy": one_copy,
            "prefix_tokens": len(shared)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model directory (default: SmolLM2)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1k tokens, 1 rep, 4 turns")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.reps = [1024], 1
    loaded = load_model(args.model) if args.model else load_models(["smollm2"], ROOT)["smollm2"]
    model_arg = args.model or ""
    print(f"model: {loaded.path.name}\n")
    print("| prompt tokens | restart after kill -9 s | cold prefill s | ratio | cached |")
    print("|---|---|---|---|---|")
    for size in args.sizes:
        got = restart_after_kill(loaded, model_arg, size, args.reps)
        ratio = got["warm_s"].median / got["cold_s"].median
        print(f"| {size} | {got['warm_s']} | {got['cold_s']} | {ratio:.3f} | "
              f"{got['cached_tokens']} |", flush=True)  # fmt: skip
    turns = 4 if args.quick else 8
    decode = decode_with_write_behind(loaded, 1024, turns, 64)
    print("\n| decode tok/s, write-behind on | off | on/off | written per generated token | "
          "written per token held | K/V per token |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    print(f"| {decode['on']} | {decode['off']} | {decode['ratio']:.3f} | "
          f"{format_bytes(int(decode['per_generated']))} | "
          f"{format_bytes(int(decode['per_held']))} | "
          f"{format_bytes(int(decode['kv_per_token']))} |")  # fmt: skip
    shared = shared_prefix_bytes(loaded, 1024, 8)
    print("\n| 8 conversations, one system prompt | files | on disk | one copy of it + 8 tails |")
    print("|---|---|---|---|")
    print(f"| {shared['prefix_tokens']}-token prompt | {shared['files']} | "
          f"{format_bytes(shared['on_disk'])} | {format_bytes(shared['one_copy'])} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
