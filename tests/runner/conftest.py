"""Fixtures of the runner's tests that several files share."""

from __future__ import annotations

import threading

import pytest

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
