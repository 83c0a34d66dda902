"""A scan of the disk tier's directory lists the reply records before the blocks: another
process writes a reply's blocks, then its record, so a record the scan lists has its blocks
listed too, and the sweep of records whose chains are gone never takes one it just missed the
blocks of. Deterministic: the other process's write runs from a hook between two listings."""

from __future__ import annotations

import logging
import os
import re
import threading

import numpy as np
import pytest

from mlxkv.cache import make_cache
from mlxkv.cache.serialize import layout_signature
from mlxkv.runner.disk import replies as replies_module
from mlxkv.runner.disk import store as store_module

PROMPT = list(range(10, 30))
REPLY = [40, 41, 42]
SAID = ("a reply", None, None)  # its text, salt and context


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
            job = writing.replies.job(through, REPLY, SAID, writing.block_tokens)
            writing._run_logged(job)
        return iter(listed)

    monkeypatch.setattr(store_module, "own_files", other_process_writes_meanwhile)
    starting._scanned_mtime = -1  # the directory changed: scan it
    starting.stored_replies(256)  # its scan, then the sweep of records whose blocks are gone
    assert wrote
    assert len(list(tmp_path.glob("*/*.reply"))) == 1, "the record was swept"
    starting.refresh()  # the next scan lists both
    assert starting.stored_reply(None, "a reply") == {None: REPLY}
    writing.close()
    starting.close()


def test_the_budget_sweep_waits_for_a_scan_under_way(load_tiny, tmp_path, monkeypatch):
    """The writer thread's budget sweep, run while the engine thread's scan has indexed
    another process's record but not yet its blocks, must not take that record: it waits
    for the scan (a 2 s bound on a wait that must not end; the old code swept at once)."""
    model, _ = load_tiny("llama")
    local, other = _store(model, tmp_path), _store(model, tmp_path)
    cache = make_cache(model)
    cache.forward(model, PROMPT + REPLY)
    other.write(cache, wait=True)
    through = np.asarray([*PROMPT, *REPLY[:-1]], dtype=np.uint32)
    other._run_logged(other.replies.job(through, REPLY, SAID, other.block_tokens))
    real_own_files = store_module.own_files
    swept = threading.Event()

    def budget_sweep_meanwhile(directory):
        if not swept.is_set():  # between the records' listing and the blocks'
            local.max_bytes = 1  # over the budget: its sweep of records runs
            writer = threading.Thread(target=lambda: (local.enforce_budget(), swept.set()))
            writer.start()
            assert not swept.wait(2.0), "the sweep ran beside the scan"
        return real_own_files(directory)

    monkeypatch.setattr(store_module, "own_files", budget_sweep_meanwhile)
    local._scanned_mtime = -1
    local.refresh()
    assert swept.wait(30)  # after the scan: every block it found is indexed
    assert len(list(tmp_path.glob("*/*.reply"))) == 1, "the record was swept"
    local.close()
    other.close()


def test_a_record_another_process_swept_is_written_again_behind_the_turn_holding_it(
    load_tiny, tmp_path
):
    """Another process's budget removes a turn's blocks and its reply's record (it cannot see
    this process's conversation going on); the next turn, which renders the reply as its ids,
    writes a chain that holds it: the record, seen gone at this process's scan, is written
    again behind that chain (before, it stayed gone, and a restart rendered the reply from its
    text)."""
    model, _ = load_tiny("llama")
    ours, theirs = _store(model, tmp_path), _store(model, tmp_path)
    through = [*PROMPT, *REPLY[:-1]]
    first, second = make_cache(model), make_cache(model)
    first.forward(model, through)
    second.forward(model, [*PROMPT, *REPLY, 50, 51])
    ours.write(first, wait=True)
    ours._run_logged(ours.replies.job(np.asarray(through), REPLY, SAID, 256))
    theirs.refresh()
    theirs.max_bytes = 1
    theirs.enforce_budget()  # the turn's block, then its record
    assert not list(tmp_path.glob("*/*.reply")) and not list(tmp_path.glob("*/*.safetensors"))
    ours.refresh()  # the next request's scan sees them gone
    ours.write(second, wait=True)
    ours.flush()  # the record is written behind the block
    restarted = _store(model, tmp_path)
    assert [r.ids for r in restarted.stored_replies(256)] == [REPLY]
    for store in (ours, theirs, restarted):
        store.close()


@pytest.mark.parametrize("when", ["before-its-read", "after-its-read"])
def test_a_record_another_process_removes_during_a_scan_is_not_indexed(
    load_tiny, tmp_path, monkeypatch, caplog, when
):
    """Another process's sweep removes a record this scan has listed, before or after its
    header is read (a hook): the scan neither indexes it (before, one read before the removal
    stayed indexed, counted in the budget, until the next scan) nor warns (before, one gone
    before its read was a warning that it could not be read)."""
    model, _ = load_tiny("llama")
    ours, theirs = _store(model, tmp_path), _store(model, tmp_path)
    cache = make_cache(model)
    cache.forward(model, PROMPT + REPLY)
    theirs.write(cache, wait=True)
    through = np.asarray([*PROMPT, *REPLY[:-1]], dtype=np.uint32)
    theirs._run_logged(theirs.replies.job(through, REPLY, SAID, theirs.block_tokens))
    (record,) = tmp_path.glob("*/*.reply")
    real_read = replies_module.read_reply

    def their_sweep_meanwhile(path, *args):
        if when == "before-its-read":
            path.unlink()
        reply = real_read(path, *args)
        path.unlink()
        return reply

    monkeypatch.setattr(replies_module, "read_reply", their_sweep_meanwhile)
    caplog.set_level(logging.WARNING)
    ours._scanned_mtime = -1
    ours.refresh()
    assert not record.exists()
    assert ours.stored_reply(None, "a reply") is None
    assert ours.replies.nbytes == 0
    assert record.name not in caplog.text
    ours.close()
    theirs.close()


def test_the_records_of_one_text_are_found_oldest_first_by_their_times(load_tiny, tmp_path):
    """Six records of one text (six conversations: six contexts): a store that starts
    finds them all by the text, oldest first by their files' times (the newest is what a
    render without a match takes), whatever order its scan lists them in. Each is named with
    40 hex digits, which versions before contexts (32) neither list nor remove."""
    model, _ = load_tiny("llama")
    writing = _store(model, tmp_path)
    cache = make_cache(model)
    cache.forward(model, PROMPT + REPLY)
    writing.write(cache, wait=True)
    through = np.asarray([*PROMPT, *REPLY[:-1]], dtype=np.uint32)
    contexts = [f"{i:032x}" for i in (7, 3, 5, 1, 6, 2)]
    for i, context in enumerate(contexts):
        said = ("a reply", None, context)
        writing._run_logged(writing.replies.job(through, [40 + i], said, writing.block_tokens))
        (record,) = tmp_path.glob(f"*/{replies_module.reply_name(None, 'a reply', context)}")
        os.utime(record, ns=(10**18 + i * 10**9,) * 2)  # one second apart, whatever the clock
    starting = _store(model, tmp_path)
    starting.refresh()
    assert starting.stored_reply(None, "a reply") == {c: [40 + i] for i, c in enumerate(contexts)}
    assert list(starting.stored_reply(None, "a reply")) == contexts
    names = [path.name for path in tmp_path.glob("*/*.reply")]
    assert len(names) == 6 and all(re.fullmatch(r"[0-9a-f]{40}\.reply", n) for n in names)
    writing.close()
    starting.close()
