"""Fixtures of the runner's tests that several files share."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from mlxkv.decoding import batch as batch_module
from mlxkv.runner import runner as runner_module
from mlxkv.runner.disk import store as store_module


@pytest.fixture
def held_writes(monkeypatch):
    """Background writes of blocks wait for `release` (set it to let them go); each started
    block write's name is appended to `started` (a reply record's write, queued behind its
    turn's blocks, waits with them but is not listed)."""
    release, started = threading.Event(), []
    run = store_module.DiskStore._run

    def held(self, job):
        if not job.name.endswith(store_module.SUFFIX):
            run(self, job)
            return
        started.append(job.name)
        assert release.wait(timeout=60)
        run(self, job)

    monkeypatch.setattr(store_module.DiskStore, "_run", held)
    yield release, started
    release.set()


def record_batch_steps(monkeypatch, what: Callable[[Any], Any]) -> list:
    """`what(batch)` of every batched step requests take from now on (not the load's
    warm-up's), in order: the list it returns grows as they run."""
    seen: list = []
    warming: list[bool] = []
    step = batch_module.DecodeBatch._step
    warm_up = runner_module.warm_up

    def counting(self):
        if not warming:
            seen.append(what(self))
        return step(self)

    def flagged(*args):
        warming.append(True)
        try:
            return warm_up(*args)
        finally:
            warming.pop()

    monkeypatch.setattr(batch_module.DecodeBatch, "_step", counting)
    monkeypatch.setattr(runner_module, "warm_up", flagged)
    return seen


@pytest.fixture
def rows(monkeypatch):
    """The number of rows of every batched step requests took (not the load's warm-up's)."""
    return record_batch_steps(monkeypatch, lambda batch: batch.num_rows)
