"""A temporary file a process killed mid-write left (`kill -9`) takes disk until it is cleaned:
at the next start when that process was of this pid space (`files.pid_space`), else an hour
later at the earliest (`bad_files.ORPHAN_AGE_S`: a live writer in another container looks
gone from here): the budget counts it meanwhile, so the directory keeps to `cache_dir_bytes`,
and never removes it. A file with a temporary's name that this tier did not write counts for
nothing and stays, whatever its pid space."""

from __future__ import annotations

import os
import time

import numpy as np

from mlxkv.runner.disk import bad_files
from mlxkv.runner.disk import store as store_module
from mlxkv.runner.disk.files import pid_space
from tests.runner.test_disk_superseded import _cache, _store

FIRST = list(range(10, 18))  # 2 blocks of 4
DEAD_PID = 2**22 + 7  # above Linux's pid_max: no process has it


def _temporary(directory, name: str, data: bytes, space: str = ""):
    """A temporary file of a process that is gone: named in `space` (a pid space), or as
    versions before pid spaces named them."""
    named = f"{space}-" if space else ""
    path = directory / f".tmp-{DEAD_PID}-{named}{name * 16}{store_module.SUFFIX}"
    path.write_bytes(data)
    return path


def _written(load_tiny, tmp_path):
    """The tiny model, a closed store of it holding FIRST, and the bytes of its first block."""
    model, _ = load_tiny("llama")
    writer = _store(model, tmp_path)
    writer.write(_cache(model, FIRST), wait=True)
    writer.close()
    block = next(writer.directory.glob(f"*{store_module.SUFFIX}")).read_bytes()
    return model, writer, block


def _reopened(store, root, max_bytes: int) -> store_module.DiskStore:
    """`store`'s directory opened again (its scan done) under a budget of `max_bytes`."""
    return store_module.DiskStore(
        root,
        fingerprint=store.fingerprint,
        signature=store.signature,
        max_bytes=max_bytes,
        trimmable=True,
    )


def _disk_bytes(directory) -> int:
    return sum(path.stat().st_size for path in directory.iterdir())


def test_a_temporary_file_a_killed_write_left_counts_in_the_budget(load_tiny, tmp_path):
    model, writer, block = _written(load_tiny, tmp_path)
    half = _temporary(writer.directory, "ab", block[: len(block) // 2])  # killed mid-write
    stranger = _temporary(writer.directory, "cd", b"not this tier's" * 1000)
    strangers_bytes = stranger.stat().st_size
    held_bytes = _disk_bytes(writer.directory) - strangers_bytes  # 2 blocks and the half

    counted = _store(model, tmp_path)
    assert counted.nbytes == held_bytes
    counted.close()
    store = _reopened(counted, tmp_path, held_bytes - 1)  # a byte short of them all
    assert half.exists() and stranger.exists()  # young: their writers may live
    assert _disk_bytes(store.directory) - strangers_bytes <= store.max_bytes
    assert store.nbytes <= store.max_bytes
    tokens = np.asarray(FIRST, dtype=np.uint32)
    assert store.best(tokens, len(FIRST))[1] == 4  # the tail block went, the first stays
    store.close()


def test_killed_writes_of_this_pid_space_go_at_the_next_start(load_tiny, tmp_path):
    """`kill -9` mid-write, again and again: before, each leftover stayed an hour and counted,
    so a few of them took the whole budget and every block was evicted (the tier went cold)."""
    _, writer, block = _written(load_tiny, tmp_path)
    blocks_bytes = _disk_bytes(writer.directory)
    killed = [_temporary(writer.directory, name, block, pid_space()) for name in ("ab", "cd")]
    empty = _temporary(writer.directory, "ef", b"", pid_space())  # killed before its header
    store = _reopened(writer, tmp_path, blocks_bytes)
    assert not any(path.exists() for path in [*killed, empty])
    assert store.best(np.asarray(FIRST, dtype=np.uint32), len(FIRST))[1] == len(FIRST)  # warm
    store.close()


def test_other_pid_spaces_wait_an_hour_and_foreign_files_stay(load_tiny, tmp_path):
    model, writer, block = _written(load_tiny, tmp_path)
    elsewhere = "0" * 8 if pid_space() != "0" * 8 else "1" * 8
    young = _temporary(writer.directory, "ab", block, elsewhere)  # another container's writer
    old = _temporary(writer.directory, "cd", block, elsewhere)
    foreign = _temporary(writer.directory, "ef", b"a file another program wrote" * 100)
    foreign_here = _temporary(writer.directory, "aa", b"another program's" * 100, elsewhere)
    # a container restarted: its new server has the old one's id (1, say), alive here
    restarted = writer.directory / f".tmp-{os.getpid()}-{elsewhere}-{'bb' * 16}.safetensors"
    restarted.write_bytes(block)
    hours_ago = time.time() - bad_files.ORPHAN_AGE_S - 60
    for path in (old, foreign, foreign_here, restarted):
        os.utime(path, (hours_ago, hours_ago))
    _store(model, tmp_path).close()  # opening scans the directory
    assert young.exists() and not old.exists() and not restarted.exists()
    assert foreign.exists() and foreign_here.exists()  # named like ours, not ours: left


def test_a_stranger_named_like_this_spaces_temporary_stays(load_tiny, tmp_path):
    """A user's file named as this pid space's temporary of a process gone was removed at
    the next start (its header was never read); a write killed within its header stays too
    (its few bytes prove nothing)."""
    model, writer, block = _written(load_tiny, tmp_path)
    stranger = _temporary(writer.directory, "ab", b"my notes, not the server's", pid_space())
    truncated = _temporary(writer.directory, "cd", block[:5], pid_space())
    _store(model, tmp_path).close()  # opening scans the directory
    assert stranger.read_bytes() == b"my notes, not the server's"
    assert truncated.exists()
