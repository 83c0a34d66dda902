"""A temporary file a process killed mid-write left (`kill -9`) takes disk until it is cleaned,
an hour later at the earliest (`files.ORPHAN_AGE_S`: a live writer in another container looks
gone from here): the budget counts it meanwhile, so the directory keeps to `cache_dir_bytes`,
and never removes it. A file with a temporary's name that this tier did not write counts for
nothing and stays."""

from __future__ import annotations

import numpy as np

from mlxkv.runner.disk import store as store_module
from tests.runner.test_disk_superseded import _cache, _store

FIRST = list(range(10, 18))  # 2 blocks of 4
DEAD_PID = 2**22 + 7  # above Linux's pid_max: no process has it


def _temporary(directory, name: str, data: bytes):
    path = directory / f".tmp-{DEAD_PID}-{name * 16}{store_module.SUFFIX}"
    path.write_bytes(data)
    return path


def _disk_bytes(directory) -> int:
    return sum(path.stat().st_size for path in directory.iterdir())


def test_a_temporary_file_a_killed_write_left_counts_in_the_budget(load_tiny, tmp_path):
    model, _ = load_tiny("llama")
    writer = _store(model, tmp_path)
    writer.write(_cache(model, FIRST), wait=True)
    writer.close()
    block = next(writer.directory.glob(f"*{store_module.SUFFIX}")).read_bytes()
    half = _temporary(writer.directory, "ab", block[: len(block) // 2])  # killed mid-write
    stranger = _temporary(writer.directory, "cd", b"not this tier's" * 1000)
    strangers_bytes = stranger.stat().st_size
    held_bytes = _disk_bytes(writer.directory) - strangers_bytes  # 2 blocks and the half

    counted = _store(model, tmp_path)
    assert counted.nbytes == held_bytes
    counted.close()
    store = store_module.DiskStore(  # opened under a budget one byte short of them all
        tmp_path,
        fingerprint=counted.fingerprint,
        signature=counted.signature,
        max_bytes=held_bytes - 1,
        trimmable=True,
    )
    assert half.exists() and stranger.exists()  # young: their writers may live
    assert _disk_bytes(store.directory) - strangers_bytes <= store.max_bytes
    assert store.nbytes <= store.max_bytes
    tokens = np.asarray(FIRST, dtype=np.uint32)
    assert store.best(tokens, len(FIRST))[1] == 4  # the tail block went, the first stays
    store.close()
