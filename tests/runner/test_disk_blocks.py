"""Blocks shared by content: conversations over one long system prompt store it once, a turn
writes only its new tokens' blocks, a restart loads a chain of blocks into the same answer as
a cache that never left memory, and the budget removes a chain's blocks from its end, keeping a
prefix while any conversation uses it."""

from __future__ import annotations

import logging
import re
import threading

import pytest

from mlxkv.runner.disk import store as store_module
from tests.runner.test_disk_tier import _chat, _files

BLOCK_TOKENS = 16
SYSTEM = "You are a careful assistant. " + " ".join(f"Rule {i}: be brief." for i in range(12))


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(store_module, "BLOCK_TOKENS", BLOCK_TOKENS)


def _conversations(runner, count: int) -> list[list[dict]]:
    return [
        _chat(runner, 1, start=[{"role": "system", "content": SYSTEM + f" You are number {i}."}])[0]
        for i in range(count)
    ]


def _shared_blocks(runner) -> int:
    """Whole blocks of the prompt every conversation here starts with."""
    return len(runner.encode([{"role": "system", "content": SYSTEM}])) // BLOCK_TOKENS


def test_eight_conversations_store_their_system_prompt_once(make_runner, tmp_path):
    runner = make_runner("llama", cache_entries=8, cache_dir=tmp_path)
    conversations = _conversations(runner, 8)
    store = runner._pool.store
    store.flush()
    records = list(store._records.values())
    shared = _shared_blocks(runner)
    assert shared >= 3
    prefix = [r for r in records if r.start < shared * BLOCK_TOKENS]
    assert len(prefix) == shared  # one copy of each block of the shared prompt
    assert len(_files(tmp_path)) == len(records)
    # each conversation is a chain through those blocks to its own tail
    for messages in conversations:
        tokens = runner._pool.store.block_keys(
            store_module.np.asarray(runner.encode(messages[:-1]), dtype="uint32")
        )
        assert {key + ".safetensors" for key in tokens[:shared]} == {r.path.name for r in prefix}
    # and comes back from disk as it was in memory
    restarted = make_runner("llama", cache_entries=8, cache_dir=tmp_path)
    reference = make_runner("llama", cache_entries=8)
    assert _conversations(reference, 8) == conversations
    for messages in conversations:
        follow_up = messages + [{"role": "user", "content": "Why?"}]
        got = restarted.generate(follow_up, max_tokens=5)
        want = reference.generate(follow_up, max_tokens=5)
        assert got.tokens == want.tokens
        assert got.cached_tokens == want.cached_tokens > shared * BLOCK_TOKENS


@pytest.mark.parametrize("arch", ["llama", "lfm2", "gemma3_text"])
def test_each_turn_writes_only_its_new_tokens(make_runner, tmp_path, caplog, arch):
    runner = make_runner(arch, cache_entries=2, cache_dir=tmp_path)
    turns = 6
    with caplog.at_level(logging.DEBUG, logger="mlxkv.runner.disk.store"):
        _chat(runner, turns)
        runner._pool.store.flush()
    written = [
        int(found.group(1))
        for record in caplog.records
        if (found := re.search(r"disk cache write tokens=(\d+)", record.getMessage()))
    ]
    held = runner._pool.latest.num_tokens
    # each token once, plus at most a block's worth rewritten per turn (the tail before it)
    assert held <= sum(written) <= held + turns * BLOCK_TOKENS, written
    chain = runner._pool.store.block_keys(runner._pool.latest.tokens)
    assert sorted(p.stem for p in _files(tmp_path)) == sorted(chain)  # no stale tail


def test_the_budget_removes_chains_from_their_end_and_keeps_shared_prefixes(make_runner, tmp_path):
    probe = make_runner("llama", cache_entries=8, cache_dir=tmp_path / "probe")
    _conversations(probe, 3)
    probe._pool.store.flush()
    three = sum(p.stat().st_size for p in _files(tmp_path / "probe"))
    runner = make_runner(
        "llama", cache_entries=8, cache_dir=tmp_path / "kv", cache_dir_bytes=int(three * 0.8)
    )
    conversations = _conversations(runner, 5)
    store = runner._pool.store
    store.flush()
    records = {r.key: r for r in store._records.values()}
    assert sum(r.nbytes for r in records.values()) <= int(three * 0.8)
    # no block is left without the blocks before it, and the shared prompt is still there
    assert all(r.parent is None or r.parent in records for r in records.values())
    assert len([r for r in records.values() if r.start < _shared_blocks(runner) * BLOCK_TOKENS])
    # the newest conversation survived whole
    newest = store_module.np.asarray(runner._pool.latest.tokens, dtype="uint32")
    assert store.holds(newest)
    restarted = make_runner("llama", cache_entries=8, cache_dir=tmp_path / "kv")
    follow_up = conversations[-1] + [{"role": "user", "content": "Why?"}]
    got = restarted.generate(follow_up, max_tokens=4)
    assert got.cached_tokens > 0
    assert got.tokens == make_runner("llama").generate(follow_up, max_tokens=4).tokens


def test_a_scan_never_forgets_a_file_written_while_it_ran(
    make_runner, tmp_path, monkeypatch, held_writes
):
    """The race behind the budget test's rare failure: a scan of the directory (the engine
    thread, at a request's start) listed it just before the writer renamed a block into place
    and indexed it; the scan then dropped that record as gone, so the index missed a file
    (a chain's parent, or the newest block) until the directory changed again."""
    release, _ = held_writes
    runner = make_runner("llama", cache_entries=4, cache_dir=tmp_path)
    runner.generate("a conversation to keep on disk", max_tokens=2)  # its write is held
    store, listed = runner._pool.store, store_module.own_files
    writes_done = []

    def listing_then_writes(directory):
        entries = listed(directory)  # the directory before the held write lands
        if not writes_done:
            release.set()
            flushing = threading.Thread(target=store.flush)
            flushing.start()
            # bounded: a write cannot land while a scan runs, so this waits it out in vain
            flushing.join(timeout=2)
            writes_done.append(not flushing.is_alive())
        return entries

    monkeypatch.setattr(store_module, "own_files", listing_then_writes)
    store._scanned_mtime = -1  # scan now, whatever the directory's time says
    store.refresh()
    store.flush()
    assert sorted(store._records) == sorted(p.name for p in _files(tmp_path))
    assert writes_done == [False]  # the write waited for the scan


def test_the_budget_keeps_the_blocks_before_a_queued_block(make_runner, tmp_path, held_writes):
    """A block whose next block is queued is not a chain's end: removed for the budget before
    that block was written, it left the block behind it on disk without the blocks before it
    (never loadable, yet counted in the budget), and the conversation's newest turn lost."""
    release, _ = held_writes
    release.set()
    runner = make_runner("llama", cache_entries=4, cache_dir=tmp_path)
    store = runner._pool.store
    first = [{"role": "user", "content": "An old conversation about rivers and their mouths."}]
    # a reply that ends the chain on a block's end: its next turn's first block follows it
    max_tokens = BLOCK_TOKENS - (len(runner.encode(first)) - 1) % BLOCK_TOKENS
    reply = runner.generate(first, max_tokens=max_tokens)
    assert reply.generation_tokens == max_tokens
    store.flush()
    second = [{"role": "user", "content": "A newer one: museums, and what they keep."}]
    runner.generate(second, max_tokens=4)
    store.flush()
    store.max_bytes = store.nbytes + store.replies.nbytes + 100  # the next block goes over
    release.clear()  # both next turns queued before either is written
    runner.generate(second + [{"role": "user", "content": "Which one first?"}], max_tokens=4)
    follow_up = first + [{"role": "assistant", "content": reply.text}]
    runner.generate(follow_up + [{"role": "user", "content": "Why?"}], max_tokens=4)
    release.set()
    store.flush()
    records = {r.key: r for r in store._records.values()}
    orphans = [r.start for r in records.values() if r.parent and r.parent not in records]
    assert not orphans, f"blocks at {orphans} without the blocks before them"
    newest = store_module.np.asarray(runner._pool.latest.tokens, dtype="uint32")
    assert store.holds(newest)  # the newest turn whole
