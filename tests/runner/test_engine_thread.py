"""The engine thread's queue (`mlxkv.runner.scheduling.engine`): an interleaved generator's first
item goes ahead of the jobs waiting (a new request's prefill starts at the next turn), its
later items take their turn."""

from __future__ import annotations

import threading

import pytest

from mlxkv.runner.scheduling.engine import EngineThread
from tests.factories import joined, wait_until


def _ask_while_held(engine: EngineThread, stream, order: list[str]) -> None:
    """With the engine busy, a job is queued, then the stream's next item is asked for;
    both run when the engine is free again."""
    gate, holding = threading.Event(), threading.Event()
    engine._submit(lambda: holding.set() or gate.wait(30))
    holding.wait(30)
    engine._submit(lambda: order.append("waiting job"))
    reader = threading.Thread(target=lambda: next(stream))
    reader.start()
    wait_until(lambda: engine._jobs.qsize() == 2, what="the item's job queued")
    gate.set()
    joined(reader, timeout_s=30)
    engine.call(lambda: None)  # after the waiting job


def test_a_new_interleaved_generator_starts_ahead_of_waiting_jobs_then_takes_turns():
    engine = EngineThread("test-engine")
    order: list[str] = []

    def items():
        order.append("first item")
        yield 1
        order.append("second item")
        yield 2

    stream = iter(engine.interleave(items))
    try:
        _ask_while_held(engine, stream, order)
        assert order == ["first item", "waiting job"]
        order.clear()
        _ask_while_held(engine, stream, order)
        assert order == ["waiting job", "second item"]
    finally:
        stream.close()
        engine.stop()


@pytest.mark.parametrize("real_job_behind", [False, True], ids=["alone", "job-behind"])
def test_jobs_waiting_counts_jobs_not_the_wake_up_a_job_run_ahead_leaves(real_job_behind):
    """A job queued, then an interleaved generator's first item (run ahead of it, leaving its
    wake-up queued behind it): neither sees a job waiting; with a real one queued, both do."""
    engine = EngineThread("test-engine")
    seen: list[bool] = []

    def items():
        seen.append(engine.jobs_waiting)
        yield 1

    stream = iter(engine.interleave(items))
    try:
        gate, holding = threading.Event(), threading.Event()
        engine._submit(lambda: holding.set() or gate.wait(30))
        holding.wait(30)
        engine._submit(lambda: seen.append(engine.jobs_waiting))
        reader = threading.Thread(target=lambda: next(stream))
        reader.start()
        wait_until(lambda: engine._jobs.qsize() == 2, what="the first item's job queued")
        if real_job_behind:
            engine._submit(lambda: None)
        gate.set()
        joined(reader, timeout_s=30)
        engine.call(lambda: None)
        assert seen == [real_job_behind] * 2
    finally:
        stream.close()
        engine.stop()
