"""Processes sharing a disk tier's directory never leave a block on disk without the block
before it (never loadable, yet held against the budget): another process's budget, which
cannot see this one's queue, removing the parent of a queued block before it is written.
Each order is made deterministic here (a gated writer), none timed."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from mlxkv.runner.disk.writer import BackgroundWriter
from tests.runner.test_disk_superseded import _cache, _orphans, _store

# Blocks of 4 tokens (`_store`): FIRST holds blocks X and Y; LONGER is FIRST, then a block
# after Y.
FIRST = list(range(10, 18))
LONGER = FIRST + [70, 71, 72, 73]


@pytest.fixture
def tiny(load_tiny):
    model, _ = load_tiny("llama")
    return model


def _gate(store) -> tuple[threading.Event, threading.Event]:
    """Holds `store`'s writer at its next job: (set when it is held, set to let it go)."""
    held, release = threading.Event(), threading.Event()

    def gated(job):
        held.set()
        assert release.wait(30)
        store._run_logged(job)

    store._writer = BackgroundWriter(gated)
    return held, release


def test_a_queued_block_whose_parent_another_process_evicted_is_not_left_behind(tiny, tmp_path):
    ours = _store(tiny, tmp_path)
    ours.write(_cache(tiny, FIRST), wait=True)
    theirs = _store(tiny, tmp_path)  # indexes X and Y at its start
    held, release = _gate(ours)
    ours.write(_cache(tiny, LONGER))  # X and Y indexed: only the third block is queued
    assert held.wait(30)
    theirs.max_bytes = 1  # their budget takes Y and X: it cannot see our queue
    theirs.enforce_budget()
    assert not any(tmp_path.glob("*/*.safetensors")), "their budget left a block"
    release.set()
    ours.flush()
    assert _orphans(ours) == []
    ours.refresh()  # the next request's scan: the chain is written again, whole
    ours.write(_cache(tiny, LONGER), wait=True)
    assert ours.best(np.asarray(LONGER, dtype=np.uint32), len(LONGER))[1] == len(LONGER)
    ours.close()
    theirs.close()
