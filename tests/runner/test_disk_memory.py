"""The disk tier gives memory back: an entry handed to the background writer is freed once
written, and a Runner that is closed and dropped leaves neither a writer thread nor memory
behind (issue: +1 entry per request with a disk tier, never given back)."""

from __future__ import annotations

import gc
import threading
import weakref

import mlx.core as mx
import pytest

from mlxkv.runner.disk import store as store_module

EVICTIONS = 200


def _settled_memory() -> int:
    gc.collect()
    mx.synchronize()
    return mx.get_active_memory()


@pytest.mark.parametrize("speculative", ["auto", None], ids=["auto", "off"])
def test_evictions_to_disk_give_their_memory_back(make_runner, loaded_tiny, tmp_path, speculative):
    loaded_tiny("llama")  # the weights stay loaded for the session: not counted
    start = _settled_memory()
    runner = make_runner(
        "llama", max_context=256, cache_entries=1, cache_dir=tmp_path, speculative=speculative
    )
    settled = entry_bytes = 0
    for turn in range(EVICTIONS):
        # each prompt starts apart from the last one's, so its entry evicts the last (to disk)
        runner.generate(f"{turn} the history of conversation {turn}", max_tokens=4)
        if turn == 9:
            runner._pool.store.flush()
            settled, entry_bytes = _settled_memory(), runner.cache_info().held_bytes
    runner._pool.store.flush()
    assert runner._pool.store.num_entries >= EVICTIONS - 10
    assert _settled_memory() - settled <= entry_bytes

    runner.close()
    dropped = weakref.ref(runner)
    del runner
    gc.collect()
    assert dropped() is None
    assert not [t for t in threading.enumerate() if t.name == "mlxkv-disk-writer"]
    assert _settled_memory() - start <= entry_bytes // 4  # what MLX keeps, not an entry


def test_a_runner_dropped_without_close_stops_its_writer(make_runner, tmp_path):
    runner = make_runner("llama", cache_entries=1, cache_dir=tmp_path)
    for turn in range(3):
        runner.generate(f"{turn} apart {turn}", max_tokens=2)
    ended = runner._pool.store._writer.ended
    assert ended is not None and not ended.is_set()
    del runner
    gc.collect()
    assert ended.wait(timeout=30)


def test_a_hybrid_models_block_is_queued_once_and_counts_what_it_holds(
    make_runner, tmp_path, held_writes
):
    release, started = held_writes
    runner = make_runner("lfm2", cache_entries=4, cache_dir=tmp_path)  # recurrent and K/V
    runner.generate("a conversation to keep on disk", max_tokens=2)  # written behind
    store, cache = runner._pool.store, runner._pool.latest.cache
    assert store.holds(store_module.np.asarray(cache.tokens, dtype=store_module.np.uint32))
    queued = store._writer._queued.values()
    (job,) = [j for j in queued if j.name.endswith(store_module.SUFFIX)]  # and a reply record
    # the K/V copied and the recurrent state at its end (and at its checkpoint)
    job_bytes = sum(a.nbytes for a in job.arrays.values())
    assert store.pending_writes.nbytes == job_bytes > cache.used_bytes
    store.write(cache)  # evicted meanwhile: already queued
    assert store.pending_writes.nbytes == job_bytes
    release.set()
    store.flush()
    assert len(started) == 1
    assert store.pending_writes.nbytes == 0


def test_blocks_queued_hold_copies_of_their_tokens_only(make_runner, tmp_path, held_writes):
    release, started = held_writes
    runner = make_runner("llama", cache_entries=4, cache_dir=tmp_path)  # plain K/V: blocks
    runner.generate("a conversation to keep on disk", max_tokens=2)  # written behind
    store, cache = runner._pool.store, runner._pool.latest.cache
    assert store.block_tokens is not None
    # copies of the tokens' K/V: no view keeps the entry's buffers (which it updates in place)
    assert store.pending_writes.nbytes == cache.used_bytes < cache.nbytes
    store.write(cache)  # evicted meanwhile: already queued
    assert store.pending_writes.nbytes == cache.used_bytes
    # the report counts each job queued or being written (the blocks and the reply record)
    report = runner.cache_info()
    assert report.disk_pending_writes == len(store._writer._queued) >= 2
    assert report.disk_pending_bytes == cache.used_bytes
    release.set()
    store.flush()
    assert len(started) == 1
    assert store.pending_writes == store_module.PendingWrites(num_jobs=0, nbytes=0)
    report = runner.cache_info()
    assert (report.disk_pending_writes, report.disk_pending_bytes) == (0, 0)


def test_the_budget_holds_with_the_turn_just_queued_for_disk(make_runner, tmp_path, held_writes):
    """A turn's blocks queued for disk are copies of its K/V (above), counted in the budget:
    the request that queues them evicts for them too, not only for what it held before."""
    release, _ = held_writes
    first = [{"role": "user", "content": "A first conversation, about rivers and their mouths."}]
    second = [{"role": "user", "content": "Another one entirely: museums, and what they keep."}]
    probe = make_runner("llama", cache_entries=3, cache_dir=tmp_path / "probe")
    for messages in (first, second):
        probe.generate(messages, max_tokens=4)
    both = probe.cache_info()  # both entries and both turns' blocks, still queued
    assert both.disk_pending_bytes > 0 and len(both.entries) == 2
    budget = both.held_bytes - 1  # one byte short of keeping both entries beside both writes
    runner = make_runner("llama", cache_entries=3, cache_bytes=budget, cache_dir=tmp_path / "run")
    for messages in (first, second):
        runner.generate(messages, max_tokens=4)
        assert runner.cache_info().held_bytes <= budget
    assert [e.current for e in runner.cache_info().entries] == [True]  # the first one evicted
    release.set()


def test_writes_queued_behind_a_slow_disk_stay_within_the_budget(
    make_runner, tmp_path, held_writes, caplog
):
    """A disk slower than the requests (its writes held here) queues copies of each turn's
    K/V: once they hold over the budget, a further write is skipped with a warning instead of
    queued (they grew by one conversation per request, without bound, before)."""
    release, _ = held_writes
    one = make_runner("llama", cache_dir=tmp_path / "probe")
    one.generate("conversation 00: a question about rivers", max_tokens=4)
    write_bytes = one.cache_info().disk_pending_bytes  # every conversation below writes as much
    budget = 3 * write_bytes
    runner = make_runner("llama", cache_entries=8, cache_bytes=budget, cache_dir=tmp_path / "run")
    for n in range(12):
        runner.generate(f"conversation {n:02d}: a question about rivers", max_tokens=4)
        pending = runner.cache_info().disk_pending_bytes
        assert pending <= budget + write_bytes, f"request {n}: {pending} bytes queued"
    assert "queued for disk are over the memory budget" in caplog.text
    release.set()
    runner._pool.store.flush()
    assert runner._pool.store.num_entries >= 3  # what was queued is written
