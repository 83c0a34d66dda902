"""The engine thread's queue (`mlxkv.engine.engine_thread`): an interleaved generator's first
item goes ahead of the jobs waiting (a new request's prefill starts at the next turn), its
later items take their turn."""

from __future__ import annotations

import threading

from mlxkv.engine.engine_thread import EngineThread
from tests.factories import wait_until


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
    reader.join(30)
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
