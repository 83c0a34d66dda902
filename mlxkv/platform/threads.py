"""MLX streams of threads other than the main one, and the threads kept to run MLX work.

MLX gives each thread its own default stream. When a thread that ran MLX work ends, the C++
teardown of its streams can race the process's own exit and abort it ("terminate called without
an active exception", exit 134). Destroying them on that thread, when its Python state is
cleared (before `Thread.join` returns), removes the race (`release_streams_at_thread_exit`).
And MLX keeps the native threads of a thread's streams after that thread ends, cleared or not:
a server that loaded and unloaded models, each with an engine thread and a disk writer on new
threads, grew by about 3 OS threads and 1.8 MiB a load. So long-lived MLX work (a Runner's
engine, the disk tier's writer) runs on kept threads (`run_on_kept_thread`): one ended run
leaves its thread idle for the next, on the same streams; idle ones end at exit.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

_thread_local = threading.local()


class _StreamReleaser:
    """Lives in one thread's `threading.local`; freed on that thread when the thread ends, or
    in a child forked meanwhile (a `subprocess` `preexec_fn`, a forked worker), whose copy of
    the thread's state is cleared: there the streams' threads do not exist, and waiting for
    them (`mx.synchronize`) hung the child before it could run anything (review23c)."""

    def __init__(self) -> None:
        self._pid = os.getpid()

    def __del__(self) -> None:
        if os.getpid() != self._pid:
            return
        mx.synchronize()
        mx.clear_streams()


def release_streams_at_thread_exit() -> None:
    """Arranges for the calling thread's MLX streams to be destroyed on that thread when it
    ends (no-op on the main thread, whose streams live as long as the process)."""
    if threading.current_thread() is threading.main_thread():
        return
    if not hasattr(_thread_local, "releaser"):
        _thread_local.releaser = _StreamReleaser()


@dataclass
class KeptRun:
    """One run of a loop on a kept thread: `thread` runs it until `ended` is set."""

    thread: threading.Thread
    ended: threading.Event = field(default_factory=threading.Event)


_IDLE_NAME = "mlxkv-idle"
_idle: list[_KeptThread] = []
_idle_lock = threading.Lock()
_before_end: list[Callable[[], None]] = []


def before_kept_threads_end(hook: Callable[[], None]) -> Callable[[], None]:
    """Registers `hook` to run at exit after the engines have stopped (their exit hook runs
    first) and before the idle kept threads end: for runs that end only when told to."""
    _before_end.append(hook)
    return hook


def run_on_kept_thread(loop: Callable[[], None], name: str) -> KeptRun:
    """Runs `loop()` on an idle kept thread, else a new one, named `name` while it runs."""
    with _idle_lock:
        kept = _idle.pop() if _idle else None
    # Made outside the lock: a garbage collection while it is made can run a Runner's
    # finalizer, which waits for a run to end, and a run ends by going idle under the lock.
    if kept is None:
        kept = _KeptThread()
    run = KeptRun(kept.thread)
    kept.loops.put((loop, name, run.ended))
    return run


class _KeptThread:
    """A daemon thread running loops one after another; idle in `_idle` between them. One
    whose loop raised ends (its streams released on itself), as at exit (`_end_idle`)."""

    def __init__(self) -> None:
        self.loops: queue.SimpleQueue[tuple[Callable[[], None], str, threading.Event] | None]
        self.loops = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=_IDLE_NAME, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        release_streams_at_thread_exit()
        while (item := self.loops.get()) is not None:
            loop, self.thread.name, ended = item
            del item
            try:
                loop()
            except BaseException:
                self.thread.name = _IDLE_NAME
                ended.set()
                raise
            del loop  # a loop's frame would keep its owner alive while idle
            self.thread.name = _IDLE_NAME
            with _idle_lock:  # idle before the run's end is told: at exit, `_end_idle` (after
                _idle.append(self)  # every engine's stop returned) must find it
            ended.set()


@atexit.register
def _end_idle() -> None:
    """Ends the idle kept threads before the interpreter's teardown (after the engines,
    whose exit hook, registered later, runs first), each releasing its streams itself."""
    for hook in _before_end:
        hook()
    while True:
        with _idle_lock:  # nothing allocated under it (see `run_on_kept_thread`)
            if not _idle:
                return
            kept = _idle.pop()
        kept.loops.put(None)
        kept.thread.join()
