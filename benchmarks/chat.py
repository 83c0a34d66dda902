"""A growing chat: 10 turns, each adding ~150-250 user tokens and the model's reply, rendered
through the chat template every turn as a chat app does. Time to first token per turn for
  (a) mlx-lm with a fresh cache every turn,
  (b) mlx-lm with its LRUPromptCache used the way `mlx_lm.server` uses it (the nearest entry is
      deep-copied, generated into, and inserted back; the copy counts, as it does there),
  (c) mlxkv's Runner,
  (d) the floor: feeding only the tokens mlxkv's cache lacks, on a copy of that cache.
Also the memory per turn: KV bytes in use and allocated vs the formula, and peak RSS.
"""

from __future__ import annotations

import random
import time

import mlx.core as mx
from mlx_lm import stream_generate
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache

from benchmarks.common import Stat, filler_text, peak_rss_bytes
from mlxkv import Runner
from mlxkv.cache.building import make_cache
from mlxkv.cache.layers.base import DEFAULT_STEP_TOKENS
from mlxkv.cache.prefix import common_prefix_length
from mlxkv.decoding.prefill.chunks import prefill
from mlxkv.models.loading import LoadedModel


def measure(
    loaded: LoadedModel,
    turns: int,
    reply_tokens: int,
    conversations: int,
    fresh_turns: set[int],
    final_samples: int = 1,
) -> dict:
    """Runs the same greedy conversation `conversations` times; per turn, Stats over them.

    Args:
        fresh_turns: turns at which (a), the costly fresh-cache baseline, is measured.
        final_samples: samples of (a) and (d) per conversation at the last turn.
    """
    samples: dict[int, dict[str, list[float]]] = {}
    memory: dict[int, dict] = {}
    for _ in range(conversations):
        for turn, row, mem in _conversation(
            loaded, turns, reply_tokens, fresh_turns, final_samples
        ):
            for key, values in row.items():
                samples.setdefault(turn, {}).setdefault(key, []).extend(values)
            memory[turn] = mem
    rows = []
    for turn in range(1, turns + 1):
        stats = {key: Stat.of(values) for key, values in samples[turn].items()}
        rows.append({"turn": turn, **memory[turn], **stats})
    return {"turns": rows}


def _conversation(loaded, turns, reply_tokens, fresh_turns, final_samples):
    """Yields (turn, {measurement: [seconds]}, memory facts) for one conversation."""
    rng = random.Random(0)
    runner = Runner(loaded)
    lru = LRUPromptCache(max_size=10)
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    for turn in range(1, turns + 1):
        text = _user_text(loaded, rng.randint(150, 250), seed=turn)
        messages.append({"role": "user", "content": text})
        ids = list(loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        samples = final_samples if turn == turns else 1
        row = {"d_floor_s": [_floor(runner, ids) for _ in range(samples)]}
        if turn in fresh_turns:
            row["a_fresh_s"] = [_ttft_mlx_lm(loaded, ids)[0] for _ in range(samples)]
        start = time.perf_counter()
        cache, rest = lru.fetch_nearest_cache("model", ids)
        cache = cache or make_prompt_cache(loaded.model)
        first, tokens = _ttft_mlx_lm(loaded, rest, cache, reply_tokens, start)
        row["b_lru_s"] = [first]
        lru.insert_cache("model", ids + tokens, cache)
        out = runner.generate(messages, max_tokens=reply_tokens)
        row["c_mlxkv_s"] = [out.ttft]
        messages.append({"role": "assistant", "content": out.text})
        info = runner.cache_info()
        yield (
            turn,
            row,
            {
                "prompt_tokens": len(ids),
                "cached_tokens": out.cached_tokens,
                "kv_used_bytes": info.used_bytes,
                "kv_allocated_bytes": info.allocated_bytes,
                "kv_formula_bytes": _kv_formula_bytes(loaded, info.num_tokens),
                "kv_step_bytes": _kv_formula_bytes(loaded, DEFAULT_STEP_TOKENS),
                "peak_rss_bytes": peak_rss_bytes(),
            },
        )


def _user_text(loaded: LoadedModel, num_tokens: int, seed: int) -> str:
    """Filler text of about `num_tokens` tokens for this model's tokenizer."""
    words = 8
    while len(loaded.tokenizer.encode(filler_text(words, seed))) < num_tokens:
        words += 8
    return filler_text(words, seed)


def _ttft_mlx_lm(loaded, ids, cache=None, max_tokens=1, start=None):
    """(seconds from `start` to the first token, tokens generated) with mlx-lm."""
    start = start or time.perf_counter()
    first, tokens = None, []
    for response in stream_generate(
        loaded.model, loaded.tokenizer, ids, max_tokens=max_tokens, prompt_cache=cache
    ):
        first = first or time.perf_counter() - start
        tokens.append(response.token)
    return first, tokens


def _floor(runner: Runner, ids: list[int]) -> float:
    """Seconds to feed only the tokens the runner's cache lacks and pick one token, on a copy
    of the runner's cache (the runner itself is untouched). Before its first request a
    runner holds no entry, so the floor is then a prefill on an empty cache."""
    latest = runner._pool.latest  # benchmark-only look at the runner's entry
    cache = make_cache(runner.loaded.model) if latest is None else latest.cache.copy()
    keep = min(common_prefix_length(cache.tokens, ids), len(ids) - 1)
    if not cache.can_trim_to(keep):
        keep = 0
        cache.free()
    cache.trim_to(keep)
    start = time.perf_counter()
    logits = prefill(runner.loaded.model, cache, ids[keep:], runner.prefill_plan)
    mx.eval(mx.argmax(logits, axis=-1))
    return time.perf_counter() - start


def _kv_formula_bytes(loaded: LoadedModel, tokens: int) -> int:
    """2 x layers x kv_heads x head_dim x 4 bytes (float32) x tokens."""
    c = loaded.config
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * kv_heads * head_dim * 4 * tokens
