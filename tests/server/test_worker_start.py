"""A generation starts from the thread that built its request, without waiting for the event
loop to take its turn back; a request that fails to build, or whose client leaves while it is
built, leaves nothing running and its place in the queue free."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from mlxkv.server import worker

_BOUND_S = 5.0


class _Chunk:
    completion = None


class _Cut:
    """The last chunk of a cancelled generation, as the Runner yields it."""

    completion = SimpleNamespace(finish_reason="cancelled")


class _Runner:
    """Builds requests on the caller's thread, each waiting for `release` first."""

    max_batch = 1

    def __init__(self, fail: bool = False):
        self.building, self.release = threading.Event(), threading.Event()
        self.generating, self.closed = threading.Event(), threading.Event()
        self.fail = fail

    def stream(self, prompt, *, cancel, batched, **options):
        self.cancelled = cancel
        self.building.set()
        self.release.wait(_BOUND_S)
        if self.fail:
            raise ValueError("bad prompt")
        return self._chunks(cancel)

    def _chunks(self, cancel: threading.Event):
        try:
            self.generating.set()
            for _ in range(3):  # bounded: a generation nobody cancels ends by itself
                if cancel.wait(_BOUND_S / 3):
                    yield _Cut()
                    return
                yield _Chunk()
        finally:
            self.closed.set()

    def cancel(self) -> None:
        pass


def test_the_generation_starts_while_the_event_loop_is_busy():
    runner = _Runner()

    async def start() -> bool:
        generations = worker.GenerationWorker(runner)
        started = asyncio.create_task(generations.start("hi"))
        await asyncio.to_thread(runner.building.wait, _BOUND_S)
        runner.release.set()
        # The loop is held here: a generation started from it could not start meanwhile.
        began = runner.generating.wait(_BOUND_S)
        stream = await started
        stream.cancel()
        await asyncio.wait_for(stream.finished, _BOUND_S)
        generations.shutdown()
        return began

    assert asyncio.run(start()), "the generation waited for the event loop to start it"
    assert runner.closed.is_set()


@pytest.mark.parametrize("ending", ["bad-input", "client-left"])
def test_a_request_that_does_not_start_leaves_nothing_running(ending):
    runner = _Runner(fail=ending == "bad-input")

    async def start() -> int:
        generations = worker.GenerationWorker(runner, max_queue=1)
        started = asyncio.create_task(generations.start("hi"))
        await asyncio.to_thread(runner.building.wait, _BOUND_S)
        if ending == "client-left":
            started.cancel()
        runner.release.set()
        with pytest.raises(ValueError if ending == "bad-input" else asyncio.CancelledError):
            await started
        pending = generations._pending
        generations.shutdown()  # waits for a generation started meanwhile to end
        return pending

    assert asyncio.run(start()) == 0
    if ending == "client-left":  # built all the same: its generation cancelled, ended
        assert runner.cancelled.is_set()
        assert not runner.generating.is_set() or runner.closed.is_set()
    else:
        assert not runner.generating.is_set()


@pytest.mark.parametrize("stop", ["before-start", "while-built", "while-generating"])
def test_no_generation_goes_on_after_a_stop_signal(stop):
    """`begin_shutdown` ends what runs and refuses what comes: a request that had its worker
    before the signal (an image fetch, a long prompt being encoded) gets the 503, and one
    begun as the signal came (the Runner's own cancel reaching only those it had) ends at its
    next step, never a whole reply."""
    runner = _Runner()

    async def start() -> worker.ApiError:
        generations = worker.GenerationWorker(runner)
        if stop == "before-start":
            generations.begin_shutdown()
            with pytest.raises(worker.ApiError) as refused:
                await generations.start("hi")
            return refused.value
        started = asyncio.create_task(generations.start("hi"))
        await asyncio.to_thread(runner.building.wait, _BOUND_S)
        if stop == "while-built":
            generations.begin_shutdown()
        runner.release.set()
        stream = await started
        with pytest.raises(worker.ApiError) as ended:
            async for _ in stream:
                if stop == "while-generating":
                    generations._closing.set()  # after the Runner's cancel, before its steps
        await asyncio.wait_for(stream.finished, _BOUND_S)
        generations.shutdown()
        return ended.value

    error = asyncio.run(start())
    assert error.status == 503 and "shutting down" in str(error)
    assert stop == "while-generating" or not runner.generating.is_set()
    assert stop != "while-generating" or runner.cancelled.is_set()
