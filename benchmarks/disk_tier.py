"""The disk tier, side by side in one run: a restart after `kill -9` against a cold prefill, a
restart from blocks on disk against a cold prefill to 32k tokens (a model of SmolLM2's shape
with a 40k window; cold past `--cold-tokens` extrapolated, labelled), the load alone at
1k/8k/32k tokens, decode speed with each turn written behind against no disk tier,
bytes on disk for conversations sharing a long system prompt, bytes written per token, and
K/V quantized on disk (`cache_dir_kv_bits=8`) against K/V as computed.

    python -m benchmarks.disk_tier [--sizes 1024 8192] [--long-sizes 8192 32768] [--model PATH]
        [--sections restart long load rest] [--quick]

Targets (issue 40): restart <= 0.1x cold at 8k tokens; decode with write-behind >= 0.97x.
Prints Markdown; every timing is the median of `--reps` runs with [min-max].
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np

from benchmarks.common import Stat, filler_text, load_models, token_prompt
from mlxkv import Runner, format_bytes
from mlxkv.cache import make_cache
from mlxkv.cache.serialize import layout_signature
from mlxkv.models.fingerprint import model_fingerprint
from mlxkv.models.loading import LoadedModel, load_model
from mlxkv.runner.disk import reading
from mlxkv.runner.disk.store import DiskStore
from mlxkv.testing.factory import build_model

ROOT = Path(__file__).resolve().parents[1]
# --sections: the kill-restart table, the long restarts, the loads alone, everything else
SECTIONS = ("restart", "long", "load", "rest")

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


class _DiskLines(logging.Handler):
    """The disk tier's DEBUG lines: the bytes of its writes, and each load's seconds."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.written_bytes = 0
        self.load_s: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if found := re.search(r"disk cache write tokens=\d+ bytes=(\d+)", message):
            self.written_bytes += int(found.group(1))
        elif found := re.search(r"disk cache load .* seconds=([\d.]+)", message):
            self.load_s.append(float(found.group(1)))


@contextlib.contextmanager
def _disk_lines() -> Iterator[_DiskLines]:
    lines, store_logger = _DiskLines(), logging.getLogger("mlxkv.runner.disk.store")
    level = store_logger.level
    store_logger.addHandler(lines)
    store_logger.setLevel(logging.DEBUG)
    try:
        yield lines
    finally:
        store_logger.removeHandler(lines)
        store_logger.setLevel(level)


def decode_with_write_behind(
    loaded: LoadedModel, system_tokens: int, turns: int, reply_tokens: int, reps: int
) -> dict[str, float]:
    """Decode tokens/s of a conversation with each turn written behind, and of the same
    conversation without a disk tier, turn by turn alternating which goes first, `reps` times
    (fresh Runners each); the on/off ratio of each repetition's medians; bytes written per
    generated token, and per token the conversation holds at the end (each token's K/V
    written once would be the K/V bytes per token)."""
    system = filler_text(system_tokens * 3 // 4, seed=1)
    tps: dict[str, list[float]] = {"on": [], "off": []}
    ratios, generated, held = [], 0, 0
    with _disk_lines() as lines:
        for rep in range(reps):
            with tempfile.TemporaryDirectory() as cache_dir:
                runners = {"on": Runner(loaded, cache_dir=cache_dir), "off": Runner(loaded)}
                chats = {side: [{"role": "system", "content": system}] for side in runners}
                rep_tps: dict[str, list[float]] = {"on": [], "off": []}
                for turn in range(turns):
                    order = ("on", "off") if (rep + turn) % 2 == 0 else ("off", "on")
                    for side in order:
                        chat = chats[side]
                        question = f"Turn {turn}: {filler_text(12, turn)}"
                        chat.append({"role": "user", "content": question})
                        out = runners[side].generate(chat, max_tokens=reply_tokens)
                        chat.append({"role": "assistant", "content": out.text})
                        rep_tps[side].append(out.generation_tps)
                        generated += out.generation_tokens if side == "on" else 0
                runners["on"].close()
                held += runners["on"]._pool.latest.num_tokens
                stored = list(runners["on"]._pool.store._records.values())
                kv_per_token = sum(r.nbytes for r in stored) / sum(r.num_tokens for r in stored)
            ratios.append(statistics.median(rep_tps["on"]) / statistics.median(rep_tps["off"]))
            for side in tps:
                tps[side] += rep_tps[side]
    return {"on": Stat.of(tps["on"]), "off": Stat.of(tps["off"]), "ratio": Stat.of(ratios),
            "per_generated": lines.written_bytes / max(generated, 1),
            "per_held": lines.written_bytes / held, "kv_per_token": kv_per_token}  # fmt: skip


def _random_kv_store(loaded: LoadedModel, tokens: np.ndarray, cache_dir: str) -> DiskStore:
    """A disk tier under `cache_dir` holding random K/V in the model's layout for `tokens`,
    as blocks a Runner of this model finds (its fingerprint and layout): lengths past what a
    prefill here could reach in minutes, or past the model's context, cost only the write."""
    model = loaded.model
    probe = make_cache(model)
    probe.forward(model, [0])
    cache = make_cache(model)
    for layer, shaped in zip(cache.layers, probe.layers, strict=True):
        keys, values = shaped.state
        for start in range(0, tokens.size, 4096):
            size = min(4096, tokens.size - start)
            layer.update_and_fetch(
                *(mx.random.normal((*a.shape[:2], size, a.shape[3]), dtype=a.dtype)
                  for a in (keys, values))
            )  # fmt: skip
        mx.eval(layer.state)
    cache.adopt(cache.layers, tokens.tolist(), {})
    store = DiskStore(
        Path(cache_dir), fingerprint=model_fingerprint(loaded),
        signature=layout_signature(cache), max_bytes=2**40, trimmable=True,
    )  # fmt: skip
    store.write(cache, wait=True)
    return store


def load_seconds(loaded: LoadedModel, num_tokens: int, reps: int) -> dict[str, Stat | int]:
    """Seconds to load `num_tokens` of K/V from the disk tier's blocks into an empty cache,
    from the page cache (the restore alone, without a Runner): random K/V in the model's
    layout, so lengths past the model's context (SmolLM2: 8k) are measured too. Each
    repetition loads the files checked whole, one at a time (`reading.CHECK_THREADS` 1) and
    as shipped, and streamed (`LayerStream`; here nothing overlaps it: the time until every
    layer is checked and evaluated), alternating the order; and times the checks alone one
    at a time and as shipped (a phase)."""
    tokens = np.random.default_rng(0).integers(0, 1000, num_tokens).astype(np.uint32)
    threads = {"serial": 1, "parallel": reading.CHECK_THREADS, "streamed": reading.CHECK_THREADS}
    seconds: dict[str, list[float]] = {f"{k}_{w}": [] for k in threads for w in ("load", "check")}
    with tempfile.TemporaryDirectory() as cache_dir:
        store = _random_kv_store(loaded, tokens, cache_dir)
        chain, _ = store.best(tokens, num_tokens)
        for rep in range(reps):
            for kind in sorted(threads, reverse=bool(rep % 2)):
                start = time.perf_counter()
                with ThreadPoolExecutor(threads[kind]) as pool:
                    list(pool.map(reading.checked_header, chain.blocks))
                seconds[f"{kind}_check"].append(time.perf_counter() - start)
                with _check_threads(threads[kind]):
                    start = time.perf_counter()
                    restored = store.load(
                        chain, make_cache(loaded.model), streamed=kind == "streamed"
                    )
                    assert restored is not None and restored.num_tokens == num_tokens
                    mx.eval(restored.arrays())  # streamed: waits for every layer's check
                    seconds[f"{kind}_load"].append(time.perf_counter() - start)
                del restored
        nbytes = chain.nbytes
        store.close()
    return {**{key: Stat.of(values) for key, values in seconds.items()}, "nbytes": nbytes}


@contextlib.contextmanager
def _check_threads(count: int) -> Iterator[None]:
    shipped, reading.CHECK_THREADS = reading.CHECK_THREADS, count
    try:
        yield
    finally:
        reading.CHECK_THREADS = shipped


def long_model(work_dir: Path, window_tokens: int) -> LoadedModel:
    """A random-weight llama of SmolLM2-135M's shape (30 layers, hidden 576, 3 K/V heads of
    64: the same K/V bytes per token and about the same compute per token, a 512-token
    vocabulary) with a `window_tokens` context: SmolLM2's own is 8k."""
    path = work_dir / f"smollm2-shape-{window_tokens}"
    if not (path / "config.json").exists():
        shape = {"hidden_size": 576, "num_hidden_layers": 30, "intermediate_size": 1536,
                 "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                 "rope_theta": 100000.0, "tie_word_embeddings": True,
                 "max_position_embeddings": window_tokens}  # fmt: skip
        build_model("llama", path, config_overrides=shape)
    return load_model(path)


def restart_from_blocks(
    loaded: LoadedModel, num_tokens: int, cold_tokens_per_s: float | None
) -> dict[str, float | int | bool]:
    """Seconds to the first token of a `num_tokens` prompt (plus 16) in a new Runner whose
    directory holds the prompt's blocks (random K/V written by the store, as a killed process
    leaves them; from the page cache), against a cold Runner's: measured when
    `cold_tokens_per_s` is None, else the prompt at that rate (an extrapolation)."""
    prompt = token_prompt(loaded, num_tokens)
    follow_up = prompt + token_prompt(loaded, 16, seed=7)
    max_context = num_tokens + 64
    with tempfile.TemporaryDirectory() as cache_dir:
        _random_kv_store(loaded, np.asarray(prompt, dtype=np.uint32), cache_dir).close()
        start = time.perf_counter()
        runner = Runner(loaded, cache_dir=cache_dir, max_context=max_context)
        cached = _first_token(runner, follow_up)
        warm_s = time.perf_counter() - start
        runner.close()
    if cold_tokens_per_s is None:
        start = time.perf_counter()
        _first_token(Runner(loaded, max_context=max_context), follow_up)
        cold_s = time.perf_counter() - start
    else:
        cold_s = len(follow_up) / cold_tokens_per_s
    return {"warm_s": warm_s, "cold_s": cold_s, "cached_tokens": cached,
            "extrapolated": cold_tokens_per_s is not None}  # fmt: skip


def quantized_on_disk(
    loaded: LoadedModel, conversations: int, system_tokens: int, reply_tokens: int
) -> dict[str, object]:
    """Conversations restored in a new Runner from K/V stored as computed and quantized to 8
    bits: the greedy follow-up's log-probabilities (max |diff| over the tokens both replies
    share, and the share of tokens equal), bytes on disk and load seconds of each."""
    nbytes, load_s = {None: 0, 8: 0}, {None: [], 8: []}
    diffs, same = [], []
    with _disk_lines() as lines:
        for i in range(conversations):
            system = filler_text(system_tokens * 3 // 4, seed=10 + i)
            chat = [{"role": "system", "content": system},
                    {"role": "user", "content": f"Question {i}: {filler_text(12, i)}"}]  # fmt: skip
            replies = {}
            for bits in (None, 8):
                with tempfile.TemporaryDirectory() as cache_dir:
                    first = Runner(loaded, cache_dir=cache_dir, cache_dir_kv_bits=bits)
                    answer = first.generate(chat, max_tokens=reply_tokens).text
                    first.close()
                    nbytes[bits] += sum(p.stat().st_size for p in Path(cache_dir).glob("*/*"))
                    follow_up = chat + [{"role": "assistant", "content": answer},
                                        {"role": "user", "content": "Why? Say more."}]  # fmt: skip
                    restarted = Runner(loaded, cache_dir=cache_dir, cache_dir_kv_bits=bits)
                    loads = len(lines.load_s)
                    chunks = list(restarted.stream(
                        follow_up, max_tokens=reply_tokens, temperature=0, logprobs=0
                    ))  # fmt: skip
                    assert len(lines.load_s) > loads, "the follow-up did not load from disk"
                    load_s[bits] += lines.load_s[loads:]
                    replies[bits] = [(c.token, c.logprob.logprob) for c in chunks if c.logprob]
                    restarted.close()
            shared = 0
            for (a, _), (b, _) in zip(replies[None], replies[8], strict=False):
                if a != b:
                    break
                shared += 1
            pairs = zip(replies[None][:shared], replies[8][:shared], strict=True)
            diffs.append(max((abs(a[1] - b[1]) for a, b in pairs), default=0.0))
            same.append(shared / len(replies[None]))
    load_stats = {bits: Stat.of(seconds) for bits, seconds in load_s.items()}
    return {"max_diff": max(diffs), "diffs": diffs, "same": statistics.median(same),
            "nbytes": nbytes, "load_s": load_stats}  # fmt: skip


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
    parser.add_argument("--load-sizes", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--long-sizes",
        type=int,
        nargs="+",
        default=[8192, 32768],
        help="restart from blocks on a model of SmolLM2's shape, 40k window",
    )
    parser.add_argument(
        "--cold-tokens",
        type=int,
        default=8192,
        help="cold prefill measured up to this size, extrapolated past it",
    )
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--quick", action="store_true", help="1k tokens, 1 rep, 4 turns")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.long_sizes, args.reps = [1024], [1024], 1
    loaded = load_model(args.model) if args.model else load_models(["smollm2"], ROOT)["smollm2"]
    model_arg = args.model or ""
    print(f"model: {loaded.path.name}\n")
    if "restart" in args.sections:
        print("| prompt tokens | restart after kill -9 s | cold prefill s | ratio | cached |")
        print("|---|---|---|---|---|")
        for size in args.sizes:
            got = restart_after_kill(loaded, model_arg, size, args.reps)
            ratio = got["warm_s"].median / got["cold_s"].median
            print(f"| {size} | {got['warm_s']} | {got['cold_s']} | {ratio:.3f} | "
                  f"{got['cached_tokens']} |", flush=True)  # fmt: skip
    if "long" in args.sections:
        _print_long(args.long_sizes, args.cold_tokens)
    if "load" in args.sections:
        print(f"\n| tokens loaded (random K/V) | bytes | load s, checked whole 1 at a time | "
              f"load s, checked whole {reading.CHECK_THREADS} at a time | load s, streamed | "
              f"checks alone, 1 | checks alone, {reading.CHECK_THREADS} |\n"
              f"|---|---|---|---|---|---|---|")  # fmt: skip
        for size in args.load_sizes:
            got = load_seconds(loaded, size, args.reps)
            print(f"| {size} | {format_bytes(got['nbytes'])} | {got['serial_load']} | "
                  f"{got['parallel_load']} | {got['streamed_load']} | {got['serial_check']} | "
                  f"{got['parallel_check']} |", flush=True)  # fmt: skip
    if "rest" in args.sections:
        _print_rest(loaded, args)
    return 0


def _print_long(sizes: list[int], cold_tokens: int) -> None:
    """The restart from blocks against a cold prefill on `long_model`, one repetition each;
    past `cold_tokens`, the cold prefill at the rate measured at the largest size before."""
    with tempfile.TemporaryDirectory() as work_dir:
        model = long_model(Path(work_dir), 40960)
        print("\nrandom-weight llama of SmolLM2-135M's shape, 40,960-token window, 1 repetition")
        print("| prompt tokens | restart from blocks s | cold prefill s | ratio | cached |")
        print("|---|---|---|---|---|")
        rate = None
        for size in sorted(sizes):
            got = restart_from_blocks(model, size, None if size <= cold_tokens else rate)
            if not got["extrapolated"]:
                rate = (size + 16) / got["cold_s"]
            cold = f"{got['cold_s']:.1f}" + (" (extrapolated)" if got["extrapolated"] else "")
            print(f"| {size} | {got['warm_s']:.2f} | {cold} | "
                  f"{got['warm_s'] / got['cold_s']:.4f} | {got['cached_tokens']} |",
                  flush=True)  # fmt: skip


def _print_rest(loaded: LoadedModel, args: argparse.Namespace) -> None:
    """Decode with write-behind on and off, shared prefixes, K/V quantized on disk."""
    turns = 4 if args.quick else 8
    decode = decode_with_write_behind(loaded, 1024, turns, 64, args.reps)
    print("\n| decode tok/s, write-behind on | off | on/off (median of reps) | "
          "written per generated token | written per token held | K/V per token |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    print(f"| {decode['on']} | {decode['off']} | {decode['ratio']} | "
          f"{format_bytes(int(decode['per_generated']))} | "
          f"{format_bytes(int(decode['per_held']))} | "
          f"{format_bytes(int(decode['kv_per_token']))} |", flush=True)  # fmt: skip
    shared = shared_prefix_bytes(loaded, 1024, 8)
    print("\n| 8 conversations, one system prompt | files | on disk | one copy of it + 8 tails |")
    print("|---|---|---|---|")
    print(f"| {shared['prefix_tokens']}-token prompt | {shared['files']} | "
          f"{format_bytes(shared['on_disk'])} | {format_bytes(shared['one_copy'])} |",
          flush=True)  # fmt: skip
    kv = quantized_on_disk(loaded, 1 if args.quick else 3, 1024, 32)
    print("\n| K/V on disk | bytes | load s | follow-up log-prob max abs diff | tokens equal |")
    print("|---|---|---|---|---|")
    print(f"| as computed | {format_bytes(kv['nbytes'][None])} | {kv['load_s'][None]} | - | - |")
    diffs = ", ".join(f"{d:.3g}" for d in kv["diffs"])
    print(f"| 8 bits | {format_bytes(kv['nbytes'][8])} | {kv['load_s'][8]} | "
          f"{kv['max_diff']:.3g} ({diffs}) | {kv['same']:.0%} |")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
