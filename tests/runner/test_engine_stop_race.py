"""Review rs9b: a job submitted while a stop is being taken must run (not be lost)."""

from __future__ import annotations

import queue
import threading

from mlxkv.runner.scheduling.engine import EngineThread
from tests.factories import joined

# The longest a lagging put waits for the loop to look at the queue: where `_submit` holds its
# lock through the put (as it must), the loop cannot look until the put is done, so the put
# goes on after this; where it did not, the loop looks at once and the job put after is lost.
_LOOK_WAIT_S = 2.0


class _SlowPutQueue:
    """A SimpleQueue whose put of a real job lags until the loop has looked whether the queue
    is empty (as a thread preempted between `_submit`'s check and its `put`), at most
    `_LOOK_WAIT_S`. `putting` is set once that put has begun (the check made)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.putting = threading.Event()
        self._looked = threading.Event()

    def put(self, item) -> None:
        if item is not None and getattr(item, "slow", False):
            self.putting.set()
            self._looked.wait(_LOOK_WAIT_S)
        self._queue.put(item)

    def get(self, *args, **kwargs):
        return self._queue.get(*args, **kwargs)

    def empty(self) -> bool:
        empty = self._queue.empty()
        self._looked.set()
        return empty

    def qsize(self) -> int:
        return self._queue.qsize()


def test_a_job_submitted_as_the_engine_takes_a_stop_still_runs():
    engine = EngineThread("test-engine-stop-race")
    jobs = engine._jobs = _SlowPutQueue()
    gate, holding = threading.Event(), threading.Event()
    engine._submit(lambda: holding.set() or gate.wait(30))
    assert holding.wait(30)
    engine.stop(wait=False)  # queued behind the held job
    ran = threading.Event()

    def job() -> None:
        ran.set()

    job.slow = True
    submitter = threading.Thread(target=engine._submit, args=(job,))
    submitter.start()  # checks the running thread under the lock, then puts late
    assert jobs.putting.wait(30)  # past the check: the thread it saw is still running
    gate.set()  # the loop takes the stop and looks whether a job came after it
    joined(submitter, timeout_s=30)
    try:
        assert ran.wait(5), "the job given while the stop was taken never ran"
    finally:
        engine.stop()
