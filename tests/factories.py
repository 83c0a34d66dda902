"""Test helpers: K/V whose values name their positions, and tiny real models."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxkv.testing.factory import build_model

HEADS = 2
HEAD_DIM = 4


def make_kv(positions, heads: int = HEADS, head_dim: int = HEAD_DIM) -> tuple[mx.array, mx.array]:
    """Keys and values (1, heads, L, head_dim) in which every element equals its position.

    Values are the negated positions, so a mix-up of keys and values shows too.
    """
    pos = np.asarray(list(positions), dtype=np.float32)
    keys = np.broadcast_to(pos[None, None, :, None], (1, heads, len(pos), head_dim))
    return mx.array(keys), mx.array(-keys)


def assert_shared_view(cache, keys: mx.array, values: mx.array) -> None:
    """A KV-shared layer (Gemma 3n, AFM) reads `cache.keys_and_values()` after the owner's
    update: it must see exactly the K/V, in the slot order, that the update returned."""
    shared_keys, shared_values = cache.keys_and_values()
    assert positions_of(shared_keys) == positions_of(keys)
    assert positions_of(-shared_values) == positions_of(-values)


def positions_of(keys: mx.array) -> list[int]:
    """Reads back the positions stored in keys made by `make_kv` (first head, first dim)."""
    return [int(p) for p in np.array(keys[0, 0, :, 0])]


@cache
def tiny_model_dir(arch: str, root: str) -> Path:
    """Builds (once per session and root) the tiny factory model of `arch`."""
    return build_model(arch, Path(root) / arch)


def fail_layer_update(monkeypatch, fail_at: int, error: type[BaseException]) -> None:
    """Makes the `fail_at`-th K/V update (counting KVCache and SlidingWindowCache layers
    together) raise `error`: a fault at a chosen point inside the model."""
    from mlxkv.cache import KVCache, SlidingWindowCache

    calls = {"n": 0}
    for cls in (KVCache, SlidingWindowCache):
        real = cls.update_and_fetch

        def failing(self, keys, values, _real=real):
            calls["n"] += 1
            if calls["n"] == fail_at:
                raise error
            return _real(self, keys, values)

        monkeypatch.setattr(cls, "update_and_fetch", failing)


def recorded(monkeypatch, owner: Any, name: str, measure: Callable[..., Any]) -> list:
    """Every call of `owner.name` from now on (a function of a module, or a method of a class,
    `self` then first), measured by `measure(*args, **kwargs)` into the list returned, then
    run as before."""
    seen: list = []
    original = getattr(owner, name)

    def measured(*args, **kwargs):
        seen.append(measure(*args, **kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, measured)
    return seen


def wait_until(condition, timeout_s: float = 30.0, what: str = "the condition") -> None:
    """Waits for `condition()` to hold (checked every 10 ms); fails after `timeout_s` instead
    of hanging. For state another thread changes, never as a pause."""
    deadline = time.monotonic() + timeout_s
    tick = threading.Event()
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s} s"
        tick.wait(0.01)


def joined(*threads: threading.Thread, timeout_s: float = 60.0) -> None:
    """Joins `threads`, failing (naming the first still alive) after `timeout_s` each instead
    of letting a stuck one pass unnoticed to a confusing failure later."""
    for thread in threads:
        thread.join(timeout_s)
        assert not thread.is_alive(), f"thread {thread.name} still running after {timeout_s} s"


class InStep:
    """Readers of several streams, one thread each, kept in step over their first `items`
    items: each waits after its k-th (k <= `items`) until every other reader has its k-th
    too or has ended. Events, not the threads' timing, decide how the streams overlap.

    Why, for batched streams (`Runner.stream(batched=True)`): each item is computed when
    its reader asks for it, so a reader the OS leaves waiting lets the others decode their
    whole replies without it. With `items=2`, every request is decoding (counted from its
    first chunk) before any asks for its second, and every row has joined the batch before
    any reader takes a third: the last row to join gets its second token from a step with
    all the others.

    Args:
        readers: how many streams are read.
        items: how many first items of each are read in step.
    """

    _WAIT_S = 30.0  # a reader that never comes fails here instead of hanging the others

    def __init__(self, readers: int, items: int = 2):
        self._items = items
        self._taken = [0] * readers
        self._ended = [False] * readers
        self._changed = threading.Condition()

    def read(self, reader: int, stream: Iterable) -> Iterator:
        """The items of `stream`, for reader number `reader`; closing this closes it."""
        items = iter(stream)
        try:
            for item in items:
                self._took(reader)
                yield item
        finally:
            with self._changed:
                self._ended[reader] = True
                self._changed.notify_all()
            close = getattr(items, "close", None)
            if close is not None:
                close()

    def _took(self, reader: int) -> None:
        with self._changed:
            self._taken[reader] += 1
            self._changed.notify_all()
            k = self._taken[reader]
            if k > self._items:
                return
            in_step = self._changed.wait_for(
                lambda: all(
                    taken >= k or ended
                    for taken, ended in zip(self._taken, self._ended, strict=True)
                ),
                self._WAIT_S,
            )
            assert in_step, f"reader {reader} waited {self._WAIT_S} s for the others' item {k}"


def read_in_step(monkeypatch, runner, readers: int, items: int = 2) -> InStep:
    """Makes the next `readers` streams of `runner` read in step over their first `items`
    items (`InStep`) by whichever thread reads each; later ones as before. For the server,
    whose worker reads each request's stream on a thread of its own: a client's pace does
    not reach it (the server queues the chunks), so holding the clients holds nothing."""
    in_step, stream, started = InStep(readers, items), runner.stream, itertools.count()

    def stepped(*args, **kwargs):
        chunks, reader = stream(*args, **kwargs), next(started)
        return in_step.read(reader, chunks) if reader < readers else chunks

    monkeypatch.setattr(runner, "stream", stepped)
    return in_step


class GatedModel:
    """A model held at a chosen forward pass until the test releases it: the generation is
    certainly still running when the test acts (disconnects, cancels), with no race against
    the clock or against what a random model happens to say.

    Use it in place of a model: `dataclasses.replace(loaded, model=GatedModel(loaded.model))`.
    """

    _HOLD_LIMIT_S = 60.0  # a test that never releases fails here instead of hanging

    def __init__(self, model):
        self._model = model
        self._lock = threading.Lock()
        self._calls_left: int | None = None
        self.reached = threading.Event()  # set while a forward pass is held
        self._open = threading.Event()
        self._open.set()

    def hold_after(self, calls: int) -> None:
        """The next `calls` forward passes run; the one after them waits for `release()`."""
        with self._lock:
            self._calls_left = calls
            self.reached.clear()
            self._open.clear()

    def release(self) -> None:
        with self._lock:
            self._calls_left = None
            self._open.set()

    def __call__(self, *args, **kwargs):
        with self._lock:
            hold = self._calls_left == 0
            if self._calls_left:
                self._calls_left -= 1
        if hold:
            self.reached.set()
            assert self._open.wait(self._HOLD_LIMIT_S), "the test never released the model"
        return self._model(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._model, name)
