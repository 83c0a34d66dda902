"""Processes sharing a disk tier's directory never leave a block on disk without the block
before it (never loadable, yet held against the budget): another process's budget, which
cannot see this one's queue, removing the parent of a queued block before it is written; and
a scan removes such blocks, whichever way they were left (another process's budget or
superseding write removing the parents of a block it had not indexed, a corrupt parent
discarded, a process killed between a write and its removal), and nothing else. Each order
is made deterministic here (a gated writer, a hook), none timed."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from mlxkv.cache import make_cache
from mlxkv.runner.disk import store as store_module
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


# A chain apart, written after the orphan: the scan that removes the orphan keeps it.
APART = list(range(200, 208))
# Shares FIRST's first 2 tokens, then goes on otherwise: its first block supersedes X when
# X's reply starts at 2.
OTHERWISE = FIRST[:2] + list(range(100, 110))


class Killed(BaseException):
    """The process dying (kill -9): nothing after it runs."""


def _their_budget_took_the_parents(tiny, root):
    ours = _store(tiny, root)
    ours.write(_cache(tiny, FIRST), wait=True)
    theirs = _store(tiny, root)  # indexes X and Y
    ours.write(_cache(tiny, LONGER), wait=True)  # the block after Y: theirs has not seen it
    theirs.max_bytes = 1
    theirs.enforce_budget()
    return ours, theirs


def _they_superseded_the_parents(tiny, root):
    ours = _store(tiny, root)
    ours.write(_cache(tiny, FIRST), wait=True, reply_start=2)
    theirs = _store(tiny, root)
    ours.write(_cache(tiny, LONGER), wait=True, reply_start=2)
    theirs.write(_cache(tiny, OTHERWISE), wait=True, reply_start=12)  # removes Y, then X
    return ours, theirs


def _a_corrupt_parent_was_discarded(tiny, root):
    ours = _store(tiny, root)
    ours.write(_cache(tiny, LONGER), wait=True)
    y = root / ours.directory.name / (ours.block_keys(np.asarray(FIRST, dtype=np.uint32))[1])
    y = y.with_suffix(".safetensors")
    data = bytearray(y.read_bytes())
    data[-1] ^= 0xFF  # its last layer's section no longer matches its CRC
    y.write_bytes(bytes(data))
    chain, _ = ours.best(np.asarray(LONGER, dtype=np.uint32), len(LONGER))
    assert ours.load(chain, make_cache(tiny), streamed=False) is not None  # X restores
    assert not y.exists()
    return ours, ours


def _killed_between_the_rename_and_its_removal(tiny, root, monkeypatch):
    ours, theirs = _store(tiny, root), _store(tiny, root)
    ours.write(_cache(tiny, FIRST), wait=True)
    theirs.refresh()
    theirs.max_bytes = 1
    theirs.enforce_budget()  # X and Y gone; ours still indexes them

    def killed(path):
        raise Killed

    monkeypatch.setattr(store_module, "remove_own_file", killed)
    with pytest.raises(Killed):  # the block after Y is renamed in, found without Y
        ours.write(_cache(tiny, LONGER), wait=True)
    monkeypatch.undo()
    return ours, theirs


WAYS = {
    "their-budget": _their_budget_took_the_parents,
    "their-superseding": _they_superseded_the_parents,
    "corrupt-parent": _a_corrupt_parent_was_discarded,
    "killed-mid-write": _killed_between_the_rename_and_its_removal,
}


@pytest.mark.parametrize("way", list(WAYS), ids=list(WAYS))
def test_a_scan_removes_blocks_whose_parent_is_gone_and_nothing_else(
    way, tiny, tmp_path, monkeypatch
):
    make = WAYS[way]
    args = (monkeypatch,) if way == "killed-mid-write" else ()
    ours, theirs = make(tiny, tmp_path, *args)
    assert _orphans(ours), "the way left no orphan"
    ours.write(_cache(tiny, APART), wait=True)
    stranger = ours.directory / ("f" * 32 + ".safetensors")  # named as a block, not ours
    stranger.write_bytes(b"another program's file")
    ours.close()
    theirs.close()
    restarted = _store(tiny, tmp_path)  # its start's scan
    assert stranger.read_bytes() == b"another program's file"
    stranger.unlink()  # `_orphans` reads every block's header
    assert _orphans(restarted) == []
    apart = np.asarray(APART, dtype=np.uint32)
    assert restarted.best(apart, len(APART))[1] == len(APART)
    restarted.close()
