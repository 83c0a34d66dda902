"""Many conversations: interleaved chats, a restart, and the disk tier, on the default model.

1. Interleaved: 3 conversations share a ~250-token system prompt; 4 turns each with ~150-token
   user messages, round robin, plus a title request after each first turn. Total time to first
   token of mlxkv with several entries vs one entry vs mlx-lm's `LRUPromptCache` used as
   `mlx_lm.server` uses it (fetch_nearest_cache, stream_generate into the copy it returns,
   insert_cache with the prompt and generated tokens), all greedy on the same weights and
   prompt tokens. Targets: several entries <= 0.5x one entry and <= 1.0x mlx-lm, identical
   answers. Each answer is also checked against the same engine with no reuse (a fresh Runner,
   mlx-lm's `stream_generate` on a new cache): the independent reference.
2. Restart: time to first token of a conversation's next turn in a new Runner on the same
   cache_dir vs a cold prefill of the same prompt, at 1k and 8k tokens. Target: <= 0.3x.
3. Disk and memory: bytes per token on disk and in memory, write and load throughput.

Prints Markdown tables and writes JSON.

    python -m benchmarks.many_chats [--reps 3] [--restart-tokens 1000 8000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from benchmarks.common import filler_text
from mlxkv import Runner
from mlxkv.models.loading import LoadedModel, load_model

REPLY_TOKENS = 24
NUM_CHATS, NUM_TURNS = 3, 4


def _words_for_tokens(loaded: LoadedModel, num_tokens: int, seed: int) -> str:
    """Filler text of about `num_tokens` tokens."""
    words = num_tokens
    while len(loaded.tokenizer.encode(filler_text(words, seed))) > num_tokens:
        words -= max(1, words // 10)
    return filler_text(words, seed)


def _script(loaded: LoadedModel, seed: int) -> list[tuple[int, str]]:
    """(conversation, user message) in the order sent; "TITLE" marks a title request."""
    order = []
    for turn in range(NUM_TURNS):
        for chat in range(NUM_CHATS):
            text = _words_for_tokens(loaded, 150, seed * 1000 + turn * 10 + chat)
            order.append((chat, f"Turn {turn}. {text}"))
            if turn == 0:
                order.append((chat, "TITLE"))
    return order


class _MlxLmServerCache:
    """mlx_lm.server's sequential path: one LRUPromptCache (10 entries), one model."""

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.cache = LRUPromptCache(max_size=10)

    def reply(self, prompt: list[int]) -> tuple[list[int], float]:
        start = time.perf_counter()
        cache, rest = self.cache.fetch_nearest_cache("model", prompt)
        cache = cache if cache is not None else make_prompt_cache(self.loaded.model)
        cache_key, tokens, ttft = prompt[:], [], None
        for gen in stream_generate(
            self.loaded.model,
            self.loaded.tokenizer,
            rest,
            max_tokens=REPLY_TOKENS,
            sampler=make_sampler(0.0),
            prompt_cache=cache,
        ):
            ttft = ttft if ttft is not None else time.perf_counter() - start
            if gen.finish_reason == "stop" and gen.token in self.loaded.tokenizer.eos_token_ids:
                break
            tokens.append(gen.token)
            cache_key.append(gen.token)
        self.cache.insert_cache("model", cache_key, cache)
        return tokens, ttft


def _interleaved(loaded: LoadedModel, seed: int) -> dict:
    system = {"role": "system", "content": _words_for_tokens(loaded, 250, seed)}
    script = _script(loaded, seed)
    several = Runner(loaded, cache_entries=8)
    one = Runner(loaded)
    peer = _MlxLmServerCache(loaded)
    chats = [[system] for _ in range(NUM_CHATS)]
    ttft = {"several": 0.0, "one": 0.0, "mlx_lm": 0.0}
    cached = {"several": 0, "one": 0}
    mismatches: list[dict] = []  # requests whose three answers are not all equal
    # answers that differ from the same engine's with no reuse (its own cold prefill)
    off_reference = {"several": 0, "one": 0, "mlx_lm": 0}
    for index, (chat, text) in enumerate(script):
        messages = chats[chat]
        if text == "TITLE":
            messages = messages + [{"role": "user", "content": "A short title for this chat?"}]
        else:
            messages.append({"role": "user", "content": text})
        prompt = several.encode(messages)
        outs = {}
        for name, runner in (("several", several), ("one", one)):
            out = runner.generate(messages, max_tokens=REPLY_TOKENS)
            ttft[name] += out.ttft
            cached[name] += out.cached_tokens
            outs[name] = out.tokens
        outs["mlx_lm"], seconds = peer.reply(prompt)
        ttft["mlx_lm"] += seconds
        reference = {
            "mlxkv": Runner(loaded).generate(prompt, max_tokens=REPLY_TOKENS).tokens,
            "mlx_lm": _MlxLmServerCache(loaded).reply(prompt)[0],
        }
        for name, tokens in outs.items():
            off_reference[name] += tokens != reference["mlx_lm" if name == "mlx_lm" else "mlxkv"]
        if len({tuple(t) for t in outs.values()}) > 1:
            differ = [k for k in outs if outs[k] != outs["one"]]
            mismatches.append({"request": index, "differ_from_one_entry": differ})
        if text != "TITLE":
            messages.append(
                {"role": "assistant", "content": several.tokenizer.decode(outs["several"])}
            )
    mx.clear_cache()
    return {
        "ttft_s": ttft,
        "cached_tokens": cached,
        "requests": len(script),
        "mismatches": mismatches,
        "off_reference": off_reference,
    }


def _restart(loaded: LoadedModel, num_tokens: int, work: Path) -> dict:
    history = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": _words_for_tokens(loaded, num_tokens, num_tokens)},
    ]
    directory = work / f"kv-{num_tokens}"
    first = Runner(loaded, cache_entries=4, cache_dir=directory)
    out = first.generate(history, max_tokens=REPLY_TOKENS)
    history.append({"role": "assistant", "content": out.text})
    start = time.perf_counter()
    first.close()
    write_s = time.perf_counter() - start
    files = list(directory.glob("*/*.safetensors"))
    file_bytes = sum(f.stat().st_size for f in files)
    memory_bytes = first.cache_info().used_bytes
    held_tokens = first.cache_info().num_tokens
    del first
    mx.clear_cache()
    next_turn = history + [{"role": "user", "content": "Summarise that in one line."}]
    restarted = Runner(loaded, cache_entries=4, cache_dir=directory)
    warm = restarted.generate(next_turn, max_tokens=REPLY_TOKENS)
    load_bytes_per_s = restarted._pool.store.read_bytes_per_s
    del restarted
    mx.clear_cache()
    cold = Runner(loaded).generate(next_turn, max_tokens=REPLY_TOKENS)
    mx.clear_cache()
    return {
        "prompt_tokens": warm.prompt_tokens,
        "restart_ttft_s": warm.ttft,
        "cold_ttft_s": cold.ttft,
        "ratio": warm.ttft / cold.ttft,
        "restart_cached_tokens": warm.cached_tokens,
        "same_answer": warm.tokens == cold.tokens,
        "disk_bytes_per_token": file_bytes / held_tokens,
        "memory_bytes_per_token": memory_bytes / held_tokens,
        "write_bytes_per_s": file_bytes / write_s,
        "load_bytes_per_s": load_bytes_per_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--restart-tokens", type=int, nargs="+", default=[1000, 8000])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/many_chats.json"))
    args = parser.parse_args()
    loaded = load_model(None)
    rounds = [_interleaved(loaded, seed) for seed in range(args.reps)]
    totals = {k: statistics.median(r["ttft_s"][k] for r in rounds) for k in rounds[0]["ttft_s"]}
    print(f"## Interleaved chats (median total TTFT over {args.reps} rounds, "
          f"{rounds[0]['requests']} requests each)\n")  # fmt: skip
    print("| configuration | total TTFT s | vs one entry | vs mlx-lm |")
    print("|---|---|---|---|")
    names = {
        "several": "mlxkv, 8 entries",
        "one": "mlxkv, 1 entry",
        "mlx_lm": "mlx-lm LRUPromptCache",
    }
    for key, label in names.items():
        print(f"| {label} | {totals[key]:.2f} | {totals[key] / totals['one']:.2f} | "
              f"{totals[key] / totals['mlx_lm']:.2f} |")  # fmt: skip
    differ = [m for r in rounds for m in r["mismatches"]]
    print(f"\nrequests whose answers are not all equal: {len(differ)} of "
          f"{sum(r['requests'] for r in rounds)}: {differ}")  # fmt: skip
    off = {k: sum(r["off_reference"][k] for r in rounds) for k in names}
    print("answers that differ from the same engine with no reuse (a cold prefill): "
          + ", ".join(f"{names[k]} {n}" for k, n in off.items()) + "\n")  # fmt: skip
    with tempfile.TemporaryDirectory() as work:
        restarts = [_restart(loaded, n, Path(work)) for n in args.restart_tokens]
    print("## Restart (first turn after a restart vs a cold prefill)\n")
    print("| prompt tokens | restart TTFT s | cold TTFT s | ratio | cached | same answer |"
          " disk B/token | memory B/token | write MiB/s | load MiB/s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in restarts:
        print(
            f"| {r['prompt_tokens']} | {r['restart_ttft_s']:.3f} | {r['cold_ttft_s']:.2f} | "
            f"{r['ratio']:.3f} | {r['restart_cached_tokens']} | {r['same_answer']} | "
            f"{r['disk_bytes_per_token']:.0f} | {r['memory_bytes_per_token']:.0f} | "
            f"{r['write_bytes_per_s'] / 2**20:.0f} | {r['load_bytes_per_s'] / 2**20:.0f} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"interleaved": rounds, "totals": totals, "restart": restarts}, indent=2)
    )


if __name__ == "__main__":
    main()
