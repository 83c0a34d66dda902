"""A block another one supersedes goes without leaving a block behind it that lost its parent
(never loadable, yet held against the budget): not when the process dies between two
removals, not while a write queued behind the superseded block waits, and not when the
removal falls between a request's check of the parent and its put of the block after it.
Each order is made deterministic here (a hook or a gated writer), none timed."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from mlxkv.cache import make_cache
from mlxkv.cache.serialize import layout_signature
from mlxkv.runner.disk import store as store_module
from mlxkv.runner.disk.files import read_record
from mlxkv.runner.disk.writer import BackgroundWriter

BLOCK = 4
# E1 holds blocks X, Y, Z; its reply starts at 2, in X. E2 shares X's first 2 tokens and
# goes on otherwise: its first block supersedes X (and so Y and Z). E3 is E1 through Y, then
# its own third block, written behind Y.
E1 = list(range(10, 22))
E2 = E1[:2] + list(range(100, 110))
E3 = E1[: 2 * BLOCK] + [70, 71, 72, 73]


class Killed(BaseException):
    """The process dying mid-removal (kill -9): nothing after it runs."""


@pytest.fixture
def tiny(load_tiny):
    model, _ = load_tiny("llama")
    return model


def _cache(model, tokens):
    cache = make_cache(model)
    cache.forward(model, tokens)
    return cache


def _store(model, root) -> store_module.DiskStore:
    store = store_module.DiskStore(
        root,
        fingerprint="ab" * 8,
        signature=layout_signature(make_cache(model)),
        max_bytes=1 << 30,
        trimmable=True,
    )
    store.block_tokens = BLOCK
    return store


def _orphans(store) -> list[str]:
    """Blocks on disk whose parent is not on disk."""
    files = sorted(store.directory.glob(f"*{store_module.SUFFIX}"))
    records = [read_record(path, store.fingerprint, store.signature) for path in files]
    names = {path.name for path in files}
    return [
        r.path.name for r in records if r.parent and r.parent + store_module.SUFFIX not in names
    ]


def test_a_process_killed_mid_removal_leaves_no_block_without_its_parent(
    tiny, tmp_path, monkeypatch
):
    store = _store(tiny, tmp_path)
    store.write(_cache(tiny, E1), wait=True, reply_start=2)
    real_remove = store_module.remove_own_file
    removed = []

    def dies_after_one(path):
        if removed:
            raise Killed
        removed.append(path.name)
        return real_remove(path)

    monkeypatch.setattr(store_module, "remove_own_file", dies_after_one)
    with pytest.raises(Killed):
        store.write(_cache(tiny, E2), wait=True, reply_start=12)
    store.close()
    assert removed and _orphans(store) == []


def test_a_block_a_queued_write_follows_is_not_removed_as_superseded(tiny, tmp_path):
    store = _store(tiny, tmp_path)
    store.write(_cache(tiny, E1), wait=True, reply_start=2)
    running, release = threading.Event(), threading.Event()

    def gated(job):
        running.set()
        assert release.wait(30)
        store._run_logged(job)

    store._writer = BackgroundWriter(gated)
    store.write(_cache(tiny, E3), reply_start=12)  # X and Y written: E3's third block queued
    assert running.wait(30)
    store.write(_cache(tiny, E2), wait=True, reply_start=12)  # supersedes X while it waits
    release.set()
    store.close()
    assert _orphans(store) == []
    chain, served = store.best(np.asarray(E3, dtype=np.uint32), len(E3))
    assert served == len(E3) and chain is not None


def test_a_block_whose_parent_went_after_the_check_is_not_written(tiny, tmp_path, monkeypatch):
    store = _store(tiny, tmp_path)
    store.write(_cache(tiny, E1), wait=True, reply_start=2)
    y = store.block_keys(np.asarray(E3, dtype=np.uint32))[1] + store_module.SUFFIX
    real_check = store._written_or_queued
    checked = []

    def superseded_once_checked(name):
        found = real_check(name)
        if name == y and not checked:  # E2's write runs between the check of Y and the put
            checked.append(name)  # of E3's third block
            store.write(_cache(tiny, E2), wait=True, reply_start=12)
        return found

    monkeypatch.setattr(store, "_written_or_queued", superseded_once_checked)
    store.write(_cache(tiny, E3), reply_start=12)
    store.close()
    assert checked and _orphans(store) == []
