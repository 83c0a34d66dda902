"""Events a stream sends before its first token when that is late, for coding agents' idle
watchdogs: Claude Code's (`CLAUDE_STREAM_IDLE_TIMEOUT_MS`) and Codex's (`stream_idle_timeout_ms`),
300 s each, count only the events their SDKs yield, and neither yields a keep-alive (Anthropic's
`ping`, an SSE comment). A prefill of a long agent prompt on a slow machine, or a model loaded
on demand first, can take longer: the client gives up and sends the request again.

Owns `EARLY_EVENT_AFTER_S` and `marking_waits`, which marks where such an event is due; each API
says what it sends there (Anthropic an early content block kept alive by empty deltas, Responses
`response.in_progress` again). Counted from the request's arrival (`AccessLog`'s stamp).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from mlxkv.server import state
from mlxkv.server.middleware import seconds_since_arrival

# Well below the watchdogs' 300 s (a loaded machine's event loop lags), far above a short
# request's wait: a reply that starts sooner sends exactly the events it always did.
EARLY_EVENT_AFTER_S = 60.0
WAITING = object()  # in place of an event: the first one is late


async def marking_waits(events: AsyncIterator[Any], scope: dict[str, Any]) -> AsyncIterator[Any]:
    """`events`, with `WAITING` once the first has not come `EARLY_EVENT_AFTER_S` after the
    request of `scope` arrived, then again each keep-alive interval until it comes. The first
    read is waited on, never cancelled (cancelling it closes the generation), except when the
    stream itself is closed."""
    first = asyncio.ensure_future(anext(events, WAITING))  # WAITING here: no event at all
    try:
        wait_s = max(0.0, EARLY_EVENT_AFTER_S - seconds_since_arrival(scope))
        while not (await asyncio.wait({first}, timeout=wait_s))[0]:
            yield WAITING
            wait_s = state.KEEPALIVE_INTERVAL_S
    finally:
        first.cancel()  # a no-op once it has finished
    if (event := first.result()) is WAITING:
        return
    yield event
    async for event in events:
        yield event
