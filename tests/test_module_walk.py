"""One prompt's walk from `Runner.stream` to its last chunk enters each mlxkv module at most
twice (issue 25): a module entered more often is one concern spread over several calls.

An entry is a call (a generator's first step included, its later resumptions not) into a
function of an mlxkv module from a frame of any other module, mlx-lm's models included; calls
from inside the same module are not counted. Both the caller's thread and the engine thread
are watched (`threading.setprofile` reaches the engine thread, which starts with the Runner).
"""

from __future__ import annotations

import inspect
import sys
import threading
from collections import Counter

import pytest

_GENERATOR_FLAGS = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
_MAX_ENTRIES = 2


def _module_of(frame) -> str:
    return frame.f_globals.get("__name__", "") if frame is not None else ""


class _EntryCounter:
    """A profile function counting entries into mlxkv modules while `active` is set."""

    def __init__(self):
        self.active = False
        self.entries: Counter[str] = Counter()
        self._started: set = set()  # generator frames already counted (strong refs: test-only)
        self._lock = threading.Lock()

    def __call__(self, frame, event, arg):
        if event != "call" or not self.active:
            return
        module = _module_of(frame)
        if not module.startswith("mlxkv") or _module_of(frame.f_back) == module:
            return
        with self._lock:
            if frame.f_code.co_flags & _GENERATOR_FLAGS:
                if frame in self._started:
                    return  # a resumption, not a new entry
                self._started.add(frame)
            self.entries[module] += 1

    def close(self):
        self._started.clear()


def _walk_entries(make_runner) -> Counter[str]:
    counter = _EntryCounter()
    threading.setprofile(counter)  # before the Runner: its engine thread starts with it
    try:
        runner = make_runner("llama", warmup=False)
        try:
            sys.setprofile(counter)
            counter.active = True
            chunks = list(runner.stream("The capital of France is", max_tokens=6, temperature=0))
            counter.active = False
        finally:
            sys.setprofile(None)
            runner.close()
    finally:
        threading.setprofile(None)
        counter.close()
    assert chunks and chunks[-1].finish_reason is not None
    return counter.entries


# Measured on this branch (the factory llama: 2 layers; 6 greedy tokens, default drafting).
# The walk's shape belongs to the engine and decoding code, which is being restructured
# elsewhere; until then the test records the counts instead of failing the suite.
_KNOWN = (
    "modules entered more than twice: cache.layer_ops 50, cache.base 42, cache.kv 36, "
    "cache.model_cache 34, decoding.drafts 20, engine.results 15, decoding.picker 13, "
    "engine.stop_strings 9, engine.runner 7, cache.pool 7, engine.context 7, errors 5, "
    "decoding.speculative 4, engine.prompt 4, decoding.sampling 3, engine.engine_thread 3, "
    "engine.prompt_fill 3, decoding.prefill 3, cache.checkpoints 3, config 3 (per-layer and "
    "per-token calls from mlx-lm's model and the decode loop)"
)


@pytest.mark.xfail(strict=True, reason=_KNOWN)
def test_one_prompt_enters_each_module_at_most_twice(make_runner):
    entries = _walk_entries(make_runner)
    over = {module: n for module, n in entries.most_common() if n > _MAX_ENTRIES}
    assert not over, f"modules entered more than {_MAX_ENTRIES} times: {over}"


def test_the_walk_is_counted_the_same_way_twice(make_runner):
    """The counts are deterministic (greedy decoding, a fixed prompt), so the xfail above
    fails for the same reason every run."""
    first = _walk_entries(make_runner)
    assert first["mlxkv.engine.runner"] >= 1 and first["mlxkv.cache.model_cache"] >= 1
    assert _walk_entries(make_runner) == first
