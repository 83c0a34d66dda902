"""The bound on one sharded step (`mlxkv.runner.lockstep.StepWatchdog`): a step that outlives
it calls `expired` once, from the watcher's thread; a paused watchdog (a reader holding a
chunk, no request) never does."""

from __future__ import annotations

import threading

from mlxkv.runner.lockstep import StepWatchdog

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
