"""An engine thread stuck for good in a job (a sharded forward pass waiting for a rank that
froze) is abandoned: the stuck job's caller, the caller queued behind it and every later
one raise the given error at once instead of waiting without end."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from mlxkv.errors import RanksOutOfStepError
from mlxkv.runner.scheduling.engine import EngineThread, Relay
from tests.factories import joined, wait_until


def _outcome(fn: Callable[[], object]) -> str:
    try:
        return f"returned {fn()!r}"
    except RanksOutOfStepError as error:
        return f"raised {error}"


@pytest.mark.parametrize("stuck_in", ["stream", "call"])
def test_abandon_fails_the_stuck_jobs_caller_the_one_behind_it_and_every_later_one(stuck_in):
    engine = EngineThread("test-engine")
    gate, stuck = threading.Event(), threading.Event()
    relays: list[Relay] = []

    def forward() -> str:
        stuck.set()
        gate.wait(30)  # the forward pass that never ends
        return "done"

    def first_item(make: Callable) -> object:
        relays.append(relay := engine.iterate(make))
        return next(iter(relay))

    stuck_job = {
        "stream": lambda: first_item(lambda: iter([forward()])),
        "call": lambda: engine.call(forward),
    }
    job_behind = {"stream": lambda: engine.call(int), "call": lambda: first_item(lambda: iter([1]))}
    outcomes: dict[str, str] = {}
    first = threading.Thread(target=lambda: outcomes.update(stuck=_outcome(stuck_job[stuck_in])))
    second = threading.Thread(target=lambda: outcomes.update(behind=_outcome(job_behind[stuck_in])))
    try:
        first.start()
        assert stuck.wait(30)
        second.start()
        wait_until(lambda: engine._jobs.qsize() == 1, what="the job behind queued")
        engine.abandon(RanksOutOfStepError("rank 0: frozen"))
        joined(first, timeout_s=30)
        joined(second, timeout_s=30)
        assert outcomes == {"stuck": "raised rank 0: frozen", "behind": "raised rank 0: frozen"}
        assert _outcome(lambda: engine.call(int)) == "raised rank 0: frozen"
        assert _outcome(lambda: first_item(lambda: iter([1]))) == "raised rank 0: frozen"
    finally:
        gate.set()  # unstuck, the engine runs what is queued (its callers answered) and ends
        for relay in relays:
            relay.end()
        engine.stop()
