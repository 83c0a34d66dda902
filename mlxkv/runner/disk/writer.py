"""The disk tier's background writer: one thread that writes jobs in the order they came,
off the engine thread, so a request never waits for a write.

Owns `WriteJob` (a block's arrays, header metadata and file name, and the memory they keep
alive) and `BackgroundWriter` (the queue, the thread, which names are queued and the bytes they
hold; `flush` and `close`). Does not own what a job writes or how (`store.DiskStore`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from queue import Queue

import mlx.core as mx

from mlxkv.platform.threads import KeptRun, run_on_kept_thread


@dataclass
class WriteJob:
    """A background write. `held_bytes` is the memory its arrays keep alive until written: a
    block's copied K/V and the state layers' arrays it holds (shared with the entry's
    snapshots and state, so counted twice while the entry is also in memory: at most one
    entry's state layers, for the second or so a write takes)."""

    arrays: dict[str, mx.array]
    metadata: dict[str, str]
    name: str
    held_bytes: int


class BackgroundWriter:
    """Runs `run(job)` for each job put, in order, on a kept thread (`run_on_kept_thread`)
    taken at the first.

    Args:
        run: writes one job; logs its own failures (it must not raise).
    """

    def __init__(self, run: Callable[[WriteJob], None]):
        self._run = run
        self._lock = threading.Lock()  # guards _queued, _pending_bytes and _run_on
        self._queued: dict[str, WriteJob] = {}
        self._pending_bytes = 0
        self._jobs: Queue[WriteJob | None] = Queue()
        self._run_on: KeptRun | None = None

    def put(self, job: WriteJob) -> None:
        with self._lock:
            self._pending_bytes += job.held_bytes
            self._queued[job.name] = job
            if self._run_on is None:
                self._run_on = run_on_kept_thread(self._loop, "mlxkv-disk-writer")
        self._jobs.put(job)

    def is_queued(self, name: str) -> bool:
        with self._lock:
            return name in self._queued

    def queued_names(self) -> set[str]:
        with self._lock:
            return set(self._queued)

    @property
    def pending_bytes(self) -> int:
        """Memory held by jobs not yet written."""
        with self._lock:
            return self._pending_bytes

    def flush(self) -> None:
        """Waits until every job put has been written (or has failed)."""
        self._jobs.join()

    def close(self) -> None:
        """Finishes pending jobs and ends the thread's run, whose frame holds `run`'s owner
        alive. Safe to call twice, from any thread, its own included (a garbage collection
        there can run a Runner's finalizer); a later `put` starts a new run."""
        with self._lock:
            run, self._run_on = self._run_on, None
        if run is None:
            return
        self._jobs.put(None)
        if run.thread is not threading.current_thread():
            run.ended.wait()

    @property
    def ended(self) -> threading.Event | None:
        """Set when the thread's run of this writer ends (None: none started)."""
        return None if self._run_on is None else self._run_on.ended

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._run(job)
            finally:
                with self._lock:
                    self._pending_bytes -= job.held_bytes
                    self._queued.pop(job.name, None)
                # the job's arrays must not live on while this thread waits
                del job
                self._jobs.task_done()
        self._jobs.task_done()
