"""Events a stream sends while its reply shows nothing for long, for coding agents' idle
watchdogs: Claude Code's (`CLAUDE_STREAM_IDLE_TIMEOUT_MS`) and Codex's (`stream_idle_timeout_ms`),
300 s each, and langchain-openai's (`stream_chunk_timeout`, 120 s) count only the events their
SDKs yield, and none yields a keep-alive (Anthropic's `ping`, an SSE comment). A prefill of a
long agent prompt on a slow machine, or a model loaded on demand first, can take longer before
the first token; a tool call (a file an agent writes) is held until it is whole, and can take
longer to write. The client gives up and sends the request again.

Owns `EARLY_EVENT_AFTER_S`, `marking_waits`, which marks where such an event is due
(`WAITING`), and `until_due` (a wait before a stream's first event, ended by then); each API
says what it sends there (Anthropic an empty delta in the open content block, or in an empty
text block it opens; Responses `response.in_progress` again; OpenAI chat and text completions
a chunk of empty content). Before the first token, counted from the request's arrival
(`AccessLog`'s stamp).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from mlxkv.server import state
from mlxkv.server.middleware import seconds_since_arrival
from mlxkv.server.reply.turn import WAITING, Event, Turn

# Well below the watchdogs' 300 s (a loaded machine's event loop lags), far above a short
# request's wait or a token's: a reply that shows something sooner sends exactly the events it
# always did.
EARLY_EVENT_AFTER_S = 60.0
_NO_EVENT = object()
T = TypeVar("T")


async def until_due(future: asyncio.Future[T], scope: dict[str, Any]) -> T | None:
    """`future`'s result, or None once the first `WAITING` of `marking_waits` would be due
    (a wait that long must not hold back the events that mark it). Never cancels `future`."""
    wait_s = max(0.0, EARLY_EVENT_AFTER_S - seconds_since_arrival(scope))
    try:
        return await asyncio.wait_for(asyncio.shield(future), wait_s)
    except TimeoutError:
        return None


async def marking_waits(turn: Turn, scope: dict[str, Any]) -> AsyncIterator[Event | object]:
    """`turn`'s events, with `WAITING` once the first has not come `EARLY_EVENT_AFTER_S`
    after the request of `scope` arrived, then again each keep-alive interval until it comes;
    after it, each time the reply has shown nothing for `EARLY_EVENT_AFTER_S` while it goes on
    (`Turn.events`). The first read is waited on, never cancelled (cancelling it closes the
    generation), except when the stream itself is closed."""
    events = turn.events(waiting_after_s=EARLY_EVENT_AFTER_S)
    first = asyncio.ensure_future(anext(events, _NO_EVENT))
    try:
        wait_s = max(0.0, EARLY_EVENT_AFTER_S - seconds_since_arrival(scope))
        if wait_s == 0.0:  # due already (a long load): marked whether or not the first
            yield WAITING  # event is in by now, which is the generation thread's race
            wait_s = state.KEEPALIVE_INTERVAL_S
        while not (await asyncio.wait({first}, timeout=wait_s))[0]:
            yield WAITING
            wait_s = state.KEEPALIVE_INTERVAL_S
    finally:
        first.cancel()  # a no-op once it has finished
    if (event := first.result()) is _NO_EVENT:
        return
    yield event
    async for event in events:
        yield event
