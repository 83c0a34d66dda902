"""The bytes the budget counts are the bytes the entries hold: after every request of many
conversations over a small budget (alone and batched, with checkpoints and a draft model's
caches), `cache_info().held_bytes` is at least the bytes of every MLX array reachable from
the pool's entries, counted once each by an independent walk of the objects (not through
`Footprint`), and at most the budget (issue 11 recheck)."""

from __future__ import annotations

import dataclasses
import random

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxkv import Runner
from tests.runner.test_batching import _queued_then_run

WORDS = ["fox", "dog", "river", "museum", "capital", "seven", "blue"]
SYSTEM = {"role": "system", "content": "You are terse. " * 4}
_NOT_HELD = ("model", "loaded", "pool", "context", "encoder")  # references, not the entry's
_MOST_DEPTH = 8


def _array_bytes(root) -> int:
    """Bytes of the distinct MLX arrays reachable from `root` through containers and object
    attributes (models and back-references left out)."""
    seen: set[int] = set()
    total = 0
    stack = [(root, 0)]
    while stack:
        obj, depth = stack.pop()
        if depth > _MOST_DEPTH or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, mx.array):
            total += obj.nbytes
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend((item, depth + 1) for item in obj)
        elif isinstance(obj, dict):
            stack.extend((item, depth + 1) for item in obj.values())
        elif isinstance(obj, (nn.Module, np.ndarray, str, bytes, int, float)) or obj is None:
            continue
        else:
            fields = dict(getattr(obj, "__dict__", {}))
            for slot in getattr(type(obj), "__slots__", ()):
                if hasattr(obj, slot):
                    fields[slot] = getattr(obj, slot)
            stack.extend((v, depth + 1) for k, v in fields.items() if k not in _NOT_HELD)
    return total


def _assert_held(runner, budget: int) -> None:
    if runner._pool.store is not None:  # the release's own write is over budget until written
        runner._pool.store.flush()  # (`CachePool`'s invariant), then counted no more
    entries = [(entry.cache, entry.draft_cache) for entry in runner._pool.entries]
    info = runner.cache_info()
    assert _array_bytes(entries) <= info.held_bytes <= budget


def _turns(runner, loaded, batched: bool, num_conversations: int = 9, rounds: int = 3):
    """Rounds of one new user message in each conversation, in groups of 4 (sent together
    when batched); every answer equal to a fresh Runner's, the bytes checked after each
    group."""
    rng = random.Random(1)
    chats = [[SYSTEM] for _ in range(num_conversations)]
    budget = runner.cache_info().budget_bytes
    for _ in range(rounds):
        order = rng.sample(range(num_conversations), num_conversations)
        for group in (order[i : i + 4] for i in range(0, num_conversations, 4)):
            for i in group:
                chats[i].append({"role": "user", "content": " ".join(rng.choices(WORDS, k=8))})
            outs = {}

            def ask(i, outs=outs):
                outs[i] = runner.generate(chats[i], max_tokens=6, temperature=0.0, batched=batched)

            if batched:
                _queued_then_run(runner, [lambda i=i: ask(i) for i in group])
            else:
                for i in group:
                    ask(i)
            for i in group:
                fresh = Runner(loaded, max_context=512, speculative=None)
                assert outs[i].tokens == fresh.generate(chats[i], max_tokens=6).tokens
                chats[i].append({"role": "assistant", "content": outs[i].text})
            _assert_held(runner, budget)


def _budget(loaded, times: float, **options) -> int:
    probe = Runner(loaded, max_context=512, **options)
    probe.generate("The quick brown fox jumps over the lazy dog " * 3, max_tokens=4)
    return int(probe.cache_info().held_bytes * times)


@pytest.mark.parametrize("batched", [False, True], ids=["alone", "batched"])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "lfm2", "mamba"])
def test_held_bytes_are_the_arrays_the_entries_hold(loaded_tiny, arch, batched):
    loaded = loaded_tiny(arch)
    budget = _budget(loaded, 3)
    runner = Runner(loaded, max_context=512, cache_entries=6, cache_bytes=budget, max_batch=4)
    _turns(runner, loaded, batched)


@pytest.mark.parametrize("arch", ["llama", "lfm2"])
def test_held_bytes_count_the_draft_models_caches(loaded_tiny, arch, tmp_path):
    loaded = loaded_tiny(arch)
    draft = dataclasses.replace(loaded)
    budget = _budget(loaded, 3, draft=draft)
    runner = Runner(
        loaded,
        max_context=512,
        cache_entries=6,
        cache_bytes=budget,
        draft=draft,
        speculative="draft",
        cache_dir=tmp_path,
    )
    _turns(runner, loaded, batched=False, num_conversations=6, rounds=2)
    assert any(entry.draft_cache is not None for entry in runner._pool.entries)
