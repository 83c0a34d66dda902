"""A scan of the disk tier's directory lists the reply records before the blocks: another
process writes a reply's blocks, then its record, so a record the scan lists has its blocks
listed too, and the sweep of records whose chains are gone never takes one it just missed the
blocks of. Deterministic: the other process's write runs from a hook between two listings."""

from __future__ import annotations

import numpy as np

from mlxkv.cache import make_cache
from mlxkv.cache.serialize import layout_signature
from mlxkv.runner.disk import store as store_module

PROMPT = list(range(10, 30))
REPLY = [40, 41, 42]


def _store(model, root) -> store_module.DiskStore:
    return store_module.DiskStore(
        root,
        fingerprint="cd" * 8,
        signature=layout_signature(make_cache(model)),
        max_bytes=1 << 30,
        trimmable=True,
    )


def test_a_record_written_during_a_scan_is_not_swept(load_tiny, tmp_path, monkeypatch):
    model, _ = load_tiny("llama")
    starting = _store(model, tmp_path)  # as a process starting beside the writing one
    writing = _store(model, tmp_path)
    cache = make_cache(model)
    cache.forward(model, PROMPT + REPLY)
    real_own_files = store_module.own_files
    wrote = []

    def other_process_writes_meanwhile(directory):
        listed = list(real_own_files(directory))
        if not wrote:  # the other process's turn lands between this scan's two listings
            wrote.append(True)
            writing.write(cache, wait=True)
            through = np.asarray([*PROMPT, *REPLY[:-1]], dtype=np.uint32)
            job = writing.replies.job(through, REPLY, "a reply", None, writing.block_tokens)
            writing._run_logged(job)
        return iter(listed)

    monkeypatch.setattr(store_module, "own_files", other_process_writes_meanwhile)
    starting._scanned_mtime = -1  # the directory changed: scan it
    starting.stored_replies(256)  # its scan, then the sweep of records whose blocks are gone
    assert wrote
    assert len(list(tmp_path.glob("*/*.reply"))) == 1, "the record was swept"
    starting.refresh()  # the next scan lists both
    assert starting.stored_reply(None, "a reply") == REPLY
    writing.close()
    starting.close()
