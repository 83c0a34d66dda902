"""The bound on one sharded step (`mlxkv.runner.scheduling.lockstep.StepWatchdog`): a step
that outlives it calls `expired` once, from the watcher's thread; a paused watchdog (a reader
holding a chunk, no request) never does."""

from __future__ import annotations

import threading
import types

from mlxkv.runner.scheduling import lockstep
from mlxkv.runner.scheduling.lockstep import StepWatchdog

_BOUND_S = 0.1


def _watchdog() -> tuple[StepWatchdog, threading.Event, list[str]]:
    fired, threads = threading.Event(), []

    def expired() -> None:
        threads.append(threading.current_thread().name)
        fired.set()

    return StepWatchdog(_BOUND_S, expired, "test-watchdog"), fired, threads


def test_a_step_past_the_bound_calls_expired_once_from_the_watcher():
    watchdog, fired, threads = _watchdog()
    watchdog.begin()
    assert watchdog.pause()  # the ranks meet: the step ended
    watchdog.begin()  # the next one never does
    assert fired.wait(30)
    watchdog._watcher.join(30)  # it ends after calling `expired`
    assert threads == ["test-watchdog"]


def test_a_paused_watchdog_never_expires_and_a_step_after_it_does():
    watchdog, fired, _ = _watchdog()
    watchdog.begin()
    watchdog.pause()
    assert not watchdog.pause()  # a meeting outside a step (an idle follower's wait)
    assert not fired.wait(3 * _BOUND_S)
    watchdog.begin()
    assert fired.wait(30)


def test_no_thread_before_the_first_step():
    watchdog, _, _ = _watchdog()
    assert not watchdog.pause()
    assert watchdog._watcher is None


class _WatchedLock:
    """The watchdog's lock, saying (`reached`) when `engine`, once set, tries to take it."""

    def __init__(self):
        self._lock, self.engine, self.reached = threading.RLock(), None, threading.Event()

    def acquire(self, blocking=True, timeout=-1):
        if threading.current_thread() is self.engine:
            self.reached.set()
        return self._lock.acquire(blocking, timeout)

    def release(self):
        self._lock.release()

    __enter__ = acquire

    def __exit__(self, *_):
        self._lock.release()

    def _is_owned(self):
        return self._lock._is_owned()

    def _release_save(self):
        return self._lock._release_save()

    def _acquire_restore(self, state):
        self._lock._acquire_restore(state)


def test_a_step_paused_before_the_watcher_reads_the_clock_is_not_abandoned(monkeypatch):
    """The watcher reads when the step began, then the clock: a step that ended (paused) in
    between must not count as one past the bound. Here the clock's first read in the watcher
    is past the bound and is held until the pause returned or waits for the lock: either the
    watcher sees the step ended, or the step was still running when the clock passed it."""
    watchdog, fired, _ = _watchdog()
    lock = _WatchedLock()
    watchdog._armed = threading.Condition(lock)
    reading, returned, seen = threading.Event(), threading.Event(), []

    def monotonic() -> float:
        if threading.current_thread().name != "test-watchdog":
            return 0.0  # the step begins
        reading.set()  # the watcher has read the step's start: the step ends now
        if lock.reached.wait(30):
            seen.append(returned.is_set())
        return 1000 * _BOUND_S

    monkeypatch.setattr(lockstep, "time", types.SimpleNamespace(monotonic=monotonic))
    watchdog.begin()
    lock.engine = threading.current_thread()  # its pause from here
    assert reading.wait(30)
    watchdog.pause()
    returned.set()
    lock.reached.set()
    watchdog._watcher.join(30)
    assert seen and not (seen[0] and fired.is_set()), "an ended step was abandoned"
