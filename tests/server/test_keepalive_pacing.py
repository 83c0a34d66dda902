"""A stream's keep-alives (`state._with_keepalive`): sent while the next event is slow, never
between events that come in time; the events are read at most one ahead of the response, so a
client that stops reading still stalls its generation; an error reading them reaches the
response; a response closed early ends the pending read."""

from __future__ import annotations

import asyncio

import pytest

from mlxkv.server import state

KEEPALIVE = ": keep-alive\n\n"


class Source:
    """Events handed out one per `allow()`, counting how many were taken."""

    def __init__(self, fail_at: int | None = None):
        self.taken = 0
        self.closed = False
        self._allowed = asyncio.Semaphore(0)
        self._fail_at = fail_at

    def allow(self, count: int = 1) -> None:
        for _ in range(count):
            self._allowed.release()

    async def events(self):
        try:
            while True:
                await self._allowed.acquire()
                if self.taken == self._fail_at:
                    raise ValueError("reading failed")
                self.taken += 1
                yield f"data: {self.taken}\n\n"
        finally:
            self.closed = True


@pytest.fixture
def fast_keepalive(monkeypatch):
    monkeypatch.setattr(state, "KEEPALIVE_INTERVAL_S", 0.05)


async def _closing(source: Source) -> None:
    """Lets the loop run until the source's reader has been ended (a bounded wait)."""
    for _ in range(100):
        if source.closed:
            return
        await asyncio.sleep(0)
    raise AssertionError("the pending read was not ended")


def _run(test):
    asyncio.run(asyncio.wait_for(test(), timeout=30))


def test_a_slow_event_gets_keepalives_and_events_in_time_none(fast_keepalive):
    async def test():
        source = Source()
        paced = state._with_keepalive(source.events(), KEEPALIVE)
        assert await anext(paced) == KEEPALIVE  # nothing allowed yet: the interval passes
        assert await anext(paced) == KEEPALIVE
        source.allow(3)
        assert [await anext(paced) for _ in range(3)] == [f"data: {i}\n\n" for i in (1, 2, 3)]
        await paced.aclose()
        await _closing(source)

    _run(test)


def test_events_are_read_at_most_one_ahead_of_the_response():
    async def test():
        source = Source()
        source.allow(10)
        paced = state._with_keepalive(source.events(), KEEPALIVE)
        assert await anext(paced) == "data: 1\n\n"
        for _ in range(20):  # the reader runs as far as it can meanwhile
            await asyncio.sleep(0)
        assert source.taken <= 3  # the one read, one handed over, one waiting to be
        await paced.aclose()

    _run(test)


def test_an_error_reading_the_events_reaches_the_response():
    async def test():
        source = Source(fail_at=1)
        source.allow(2)
        paced = state._with_keepalive(source.events(), KEEPALIVE)
        assert await anext(paced) == "data: 1\n\n"
        with pytest.raises(ValueError, match="reading failed"):
            await anext(paced)

    _run(test)


def test_a_response_closed_early_ends_the_pending_read():
    async def test():
        source = Source()
        paced = state._with_keepalive(source.events(), KEEPALIVE)
        source.allow()
        assert await anext(paced) == "data: 1\n\n"
        await paced.aclose()  # the reader waits for the next event: cancelled
        await _closing(source)

    _run(test)


def test_the_end_of_the_events_ends_the_stream():
    async def test():
        async def two():
            yield "a"
            yield "b"

        assert [event async for event in state._with_keepalive(two(), KEEPALIVE)] == ["a", "b"]

    _run(test)
