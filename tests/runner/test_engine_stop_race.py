"""Review rs9b: a job submitted while a stop is being taken must run (not be lost)."""

from __future__ import annotations

import queue
import threading
import time

from mlxkv.runner.engine import EngineThread


class _SlowPutQueue:
    """A SimpleQueue whose put of a real job lags (as a thread preempted between `_submit`'s
    check under the lock and its `put` after it)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, item) -> None:
        if item is not None and getattr(item, "slow", False):
            time.sleep(0.5)
        self._queue.put(item)

    def get(self, *args, **kwargs):
        return self._queue.get(*args, **kwargs)

    def empty(self) -> bool:
        return self._queue.empty()

    def qsize(self) -> int:
        return self._queue.qsize()


def test_a_job_submitted_as_the_engine_takes_a_stop_still_runs():
    engine = EngineThread("test-engine-stop-race")
    engine._jobs = _SlowPutQueue()
    gate, holding = threading.Event(), threading.Event()
    engine._submit(lambda: holding.set() or gate.wait(30))
    holding.wait(30)
    engine.stop(wait=False)  # queued behind the held job
    ran = threading.Event()

    def job() -> None:
        ran.set()

    job.slow = True
    submitter = threading.Thread(target=engine._submit, args=(job,))
    submitter.start()  # checks the running thread under the lock, then puts late
    time.sleep(0.1)
    gate.set()  # the loop takes the stop and sees no job queued
    submitter.join(30)
    try:
        assert ran.wait(5), "the job given while the stop was taken never ran"
    finally:
        engine.stop()
