"""A generation waits for the event loop to send its first chunk before computing the next:
the next step would hold the GIL and the cores while the loop waits to send the first event."""

from __future__ import annotations

import asyncio
import threading

from mlxkv.server import worker

_NO_NEXT_S = 0.2  # how long the second chunk must stay unasked while the first is handled
_BOUND_S = 30.0


class _Chunk:
    completion = None


def _counted_chunks(asked: list[threading.Event]):
    for event in asked:
        event.set()
        yield _Chunk()


def test_the_second_chunk_waits_until_the_first_is_handled(monkeypatch):
    monkeypatch.setattr(worker, "FIRST_CHUNK_HANDOFF_S", _BOUND_S)
    asked = [threading.Event() for _ in range(3)]

    async def read() -> tuple[bool, bool]:
        stream = worker.GenerationStream(_counted_chunks(asked), threading.Event())
        pumped = asyncio.get_running_loop().run_in_executor(None, stream.pump)
        chunks = stream.__aiter__()
        await chunks.__anext__()  # the first chunk, being handled
        early = await asyncio.to_thread(asked[1].wait, _NO_NEXT_S)
        await chunks.__anext__()  # handled: the generation goes on
        later = asked[1].is_set()
        await chunks.aclose()
        await asyncio.wait_for(pumped, _BOUND_S)
        return early, later

    early, later = asyncio.run(read())
    assert not early, "the second chunk was computed while the first was being sent"
    assert later


def test_a_first_chunk_never_read_holds_the_generation_a_bounded_time(monkeypatch):
    monkeypatch.setattr(worker, "FIRST_CHUNK_HANDOFF_S", 0.0)
    asked = [threading.Event() for _ in range(3)]

    async def never_read() -> None:
        stream = worker.GenerationStream(_counted_chunks(asked), threading.Event())
        await asyncio.get_running_loop().run_in_executor(None, stream.pump)

    asyncio.run(never_read())
    assert all(event.is_set() for event in asked)
