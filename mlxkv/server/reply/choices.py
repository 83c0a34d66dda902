"""Several replies to one request (OpenAI's `n`): `n` generations of the same prompt, each
sampled on its own. The prompt is computed once: the others wait for the prefix the first
feeds (`runner.request_run`) and take it from the cache, then they decode together.

Owns `start_choices`, `Choices` (the request's turns seen as one where the server waits on or
stops its generation: the access line, `ReleaseModels`, a stream's end), `merged` (their
streams' events as they come) and `combined` (one Completion for the usage and the log: the
prompt once, cached as the choice that computed it saw it, every choice's tokens).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request

from mlxkv.runner.results import Completion
from mlxkv.server.errors import ApiError
from mlxkv.server.reply.turn import Turn

T = TypeVar("T")
_ENDED = object()


@dataclasses.dataclass
class _Failed:
    error: Exception


class Choices:
    """The turns of one request's choices."""

    def __init__(self, turns: list[Turn]):
        self.turns = turns

    def cancel(self) -> None:
        for turn in self.turns:
            turn.cancel()

    async def finished(self) -> Completion | None:
        """`Turn.finished` of them all, `combined`; None if none ended."""
        ended = [c for c in [await turn.finished() for turn in self.turns] if c is not None]
        return combined(ended) if ended else None


async def start_choices(
    request: Request,
    n: int,
    max_queue: int | None,
    start: Callable[[dict[str, Any]], Awaitable[Turn]],
    sampling: dict[str, Any],
) -> Choices:
    """`n` turns, each `start(its sampling)`: a `seed` gives choice i the seed + i (they
    differ, and each is repeatable). One that fails to start cancels those before it.

    Raises:
        ApiError: 400 for `n` over `max_queue` (it could never start; 429 would say retry).
    """
    if max_queue is not None and n > max_queue:
        message = f"n={n} is over the {max_queue} generations this server runs or queues at once"
        raise ApiError(400, message + " (mlxkv serve --max-queue)", param="n")
    turns: list[Turn] = []
    try:
        for index in range(n):
            seeded = sampling
            if "seed" in sampling:
                seeded = {**sampling, "seed": (sampling["seed"] + index) % 2**64}
            turns.append(await start(seeded))
    except BaseException:
        for turn in turns:
            turn.cancel()
        raise
    finally:  # what the access line and `ReleaseModels` wait for (`start_turn` kept the last)
        if len(turns) > 1:
            request.state.turn = Choices(turns)
    return Choices(turns)


def combined(completions: list[Completion]) -> Completion:
    """The first Completion with the prompt's cached tokens as the choice that computed the
    prompt saw them (the fewest) and every choice's generated tokens."""
    return dataclasses.replace(
        completions[0],
        cached_tokens=min(c.cached_tokens for c in completions),
        generation_tokens=sum(c.generation_tokens for c in completions),
    )


async def merged(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Each stream's items, with its index, as they come (one stream: read as it is, with
    nothing in between). Leaving early, or a stream that fails, stops them all; the failure is
    raised."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue(maxsize=len(streams))

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
        except Exception as error:  # raised by the reader
            await queue.put((index, _Failed(error)))
        await queue.put((index, _ENDED))

    pumps = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        running = len(pumps)
        while running:
            index, item = await queue.get()
            if item is _ENDED:
                running -= 1
            elif isinstance(item, _Failed):
                raise item.error
            else:
                yield index, item
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
