"""The disk tier's background writer: one thread that writes jobs in the order they came,
off the engine thread, so a request never waits for a write.

Owns `WriteJob` (a block's arrays, header metadata and file name, and the memory they keep
alive), `PendingWrites` (how many jobs wait and their bytes), `BackgroundWriter` (the queue,
the thread, which names are queued and the bytes they hold; `flush` and `close`) and
`write_file` (how a job's file reaches its name whole: a temporary, its CRCs, a rename, the
fsyncs). Does not own what a job holds or when it is written (`store.DiskStore`), nor the
file format (`files`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import shutil
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import mlx.core as mx

from mlxkv.platform.threads import KeptRun, before_kept_threads_end, run_on_kept_thread
from mlxkv.runner.disk.files import patch_crc, temporary_path

logger = logging.getLogger(__name__)
T = TypeVar("T")


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

    @property
    def file_bytes(self) -> int:
        """About the bytes of its file: its arrays and its header."""
        return sum(a.nbytes for a in self.arrays.values()) + len(json.dumps(self.metadata))


@dataclass(frozen=True)
class PendingWrites:
    """Jobs put and not yet written (or failed), read together under the writer's lock.

    Attributes:
        num_jobs: how many (a block or a reply record each).
        nbytes: the memory their arrays keep alive until written.
    """

    num_jobs: int
    nbytes: int

    def over(self, max_bytes: int | None) -> bool:
        """Whether they hold over `max_bytes` (None: no bound), said in a warning: the store
        then skips the entry it was about to queue."""
        if max_bytes is None or self.nbytes <= max_bytes:
            return False
        logger.warning(
            "disk cache: entry not saved: %d bytes queued for disk are over the memory budget "
            "of %d (the disk is slower than the requests)",
            self.nbytes,
            max_bytes,
        )
        return True


class BackgroundWriter:
    """Runs `run(job)` for each job put, in order, on a kept thread (`run_on_kept_thread`)
    taken at the first, until `close`.

    Args:
        run: writes one job; logs its own failures (it must not raise).
    """

    def __init__(self, run: Callable[[WriteJob], None]):
        self._run = run
        self._lock = threading.Lock()  # guards what follows but `_jobs` and `_end_asked`
        self._written = threading.Condition(self._lock)  # `_unfinished` fell to 0
        self._queued: dict[str, WriteJob] = {}
        self._pending_bytes = 0
        self._unfinished = 0  # jobs put and not yet written (or failed)
        self._jobs: queue.SimpleQueue[WriteJob | None] = queue.SimpleQueue()
        self._run_on: KeptRun | None = None  # one attribute: `close` reads it without the lock
        self._end_asked = False  # the run ends once no job is queued (see `close`)

    def put(self, job: WriteJob) -> None:
        with self._lock:
            self._pending_bytes += job.held_bytes
            self._queued[job.name] = job
            self._unfinished += 1
            if self._run_on is None:
                self._run_on = run_on_kept_thread(self._loop, "mlxkv-disk-writer")
                _running.add(self)
            self._jobs.put(job)  # under the lock: a run ending sees it queued, or ended first

    def is_queued(self, name: str) -> bool:
        with self._lock:
            return name in self._queued

    def queued_names(self) -> set[str]:
        with self._lock:
            return set(self._queued)

    def queued_jobs(self) -> list[WriteJob]:  # put and not yet written (the one running too)
        with self._lock:
            return list(self._queued.values())

    @property
    def pending(self) -> PendingWrites:
        """The jobs not yet written and the memory they hold (0 jobs: `flush` would not wait)."""
        with self._lock:
            return PendingWrites(num_jobs=self._unfinished, nbytes=self._pending_bytes)

    def flush(self) -> None:
        """Waits until every job put has been written (or has failed)."""
        with self._written:
            self._written.wait_for(lambda: self._unfinished == 0)

    def close(self, wait: bool = True) -> None:
        """Finishes pending jobs and ends the thread's run, whose frame holds `run`'s owner
        alive; with `wait`, returns when it has ended. A later `put` starts a new run.

        Takes no lock: a Runner's finalizer calls it (`wait` False: a collection can run it
        on a thread holding a lock the writes need), on any thread, the writer's own or one
        in `put` under `_lock`, about to start a run (which then ends after its job). Runs
        left at exit are waited for (`_close_all`)."""
        self._end_asked = True
        run = self._run_on
        if run is None:
            return
        self._jobs.put(None)  # SimpleQueue.put: reentrant, safe inside a collection
        if wait and run.thread is not threading.current_thread():
            run.ended.wait()

    @property
    def ended(self) -> threading.Event | None:
        """Set when the thread's run of this writer ends (None: none started)."""
        return None if self._run_on is None else self._run_on.ended

    def _loop(self) -> None:
        """The jobs, until a close and no job queued."""
        while True:
            job = self._jobs.get()
            if job is not None:
                try:
                    self._run(job)
                finally:
                    with self._lock:
                        self._pending_bytes -= job.held_bytes
                        self._queued.pop(job.name, None)
                        self._unfinished -= 1
                        if self._unfinished == 0:
                            self._written.notify_all()
                    del job  # its arrays must not live on while this thread waits
                if not self._end_asked:
                    continue
            with self._lock:  # a job put after the close runs on here
                if self._jobs.empty():
                    self._run_on, self._end_asked = None, False
                    _running.discard(self)
                    return


_running: weakref.WeakSet[BackgroundWriter] = weakref.WeakSet()


@before_kept_threads_end
def _close_all() -> None:
    """At exit, after the engines have stopped (their last turns may still write), finishes
    every writer's jobs: a Runner's finalizer does not wait for them."""
    for writer in list(_running):
        writer.close()


def write_file(
    directory: Path, job: WriteJob, lock: threading.RLock, index: Callable[[Path], T]
) -> T:
    """Writes `job` to `directory` so that its final name only ever holds it complete: under a
    temporary name, its CRC patched in and fsynced, renamed into place (with `index(path)`,
    under `lock`: a scan of the directory never sees one without the other), the directory
    fsynced. Returns what `index` returned.

    Raises:
        OSError: it could not be written (a full disk said so); no temporary file is left.
    """
    path = directory / job.name
    temporary = temporary_path(directory)
    try:
        try:  # the temporary file goes first: it took what was free before the write
            mx.save_safetensors(str(temporary), job.arrays, job.metadata)
            patch_crc(temporary)
            with lock:
                os.replace(temporary, path)
                indexed = index(path)
            fsync_directory(directory)  # the rename itself survives a power cut
        finally:
            with contextlib.suppress(OSError):
                temporary.unlink(missing_ok=True)
    except RuntimeError as error:  # MLX says "Unable to write N bytes" and not why
        raise OSError(why_unwritten(directory, job.file_bytes, error)) from error
    return indexed


def fsync_directory(directory: Path) -> None:
    """Flushes `directory`'s entries (a rename just made in it) to disk, where the platform
    allows opening a directory (it does not on Windows: the rename is then as durable as the
    file system makes it)."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def why_unwritten(directory: Path, needed_bytes: int, error: Exception) -> str:
    """MLX's write error with its likely cause (a full disk) spelled out."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return str(error)
    if free < needed_bytes + 2**20:
        return (
            f"the disk is full ({free:,} bytes free in {directory}, "
            f"the entry needs {needed_bytes:,})"
        )
    return str(error)
