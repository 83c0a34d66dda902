"""What every route needs: the generation worker, the model's name and the server's defaults.

Owns: `ServerContext` (kept on `app.state.mlxkv`: the default model's; a request naming
another served model gets that model's, loaded: `models.served.request_context`), the
`server_context` dependency, the server-sent-events framing both streaming APIs use (and
`interleaved`, the streams of a request's choices as one), and
`BoundedMap`, what an API keeps between requests (stored responses, conversations, message
threads) under one bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any, Generic, Protocol, TypeVar

from fastapi import Depends, Request
from fastapi.responses import StreamingResponse

from mlxkv.models.capabilities import Capabilities
from mlxkv.server.errors import ApiError
from mlxkv.server.models.model import ResidentModel
from mlxkv.server.models.served import ServedModels, request_context
from mlxkv.server.worker import GenerationWorker

logger = logging.getLogger(__name__)

# What a model not loaded yet is said to do when its tokenizer files cannot be read first.
_UNKNOWN = Capabilities(tools=False, tool_call_format=None, thinking=False, forced_tool_calls=False)
# Tell proxies (nginx) not to buffer the events.
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Seconds without an event (a long prefill, a wait in the queue) before a keep-alive is sent:
# clients give up on a stream that stays silent (Claude Code after 300 s), proxies sooner.
KEEPALIVE_INTERVAL_S = 5.0
SSE_KEEPALIVE = ": keep-alive\n\n"  # a comment: says nothing, keeps the connection in use


@dataclass(frozen=True)
class ServerContext:
    """Attributes:
    worker: starts generations in arrival order, up to the Runner's `max_batch` at once;
        None in a GET's context while the model is not loaded (a POST's loads it).
    model_name: the id responses carry (the served model's name).
    models: every served model, by name, and the alias patterns.
    default_max_tokens: tokens generated when a request gives no limit.
    created: when the server started (Unix seconds), for `/v1/models`.
    max_tokens_limit: most tokens one request may ask for (None: the window decides).
    fetch_images: fetch http(s) image URLs (else refuse them).
    load_duration_ns: how long this request waited for its model to load (0: it was loaded;
        Ollama's `load_duration`).

    What one API alone keeps (stored responses, diagnosed prompts) is that API's, kept on the
    app's state by the API folder that defines it.
    """

    worker: GenerationWorker | None
    model_name: str
    default_max_tokens: int
    models: ServedModels
    created: int = 0
    max_tokens_limit: int | None = None
    fetch_images: bool = False
    load_duration_ns: int = 0

    @classmethod
    def make(
        cls,
        models: ServedModels,
        default_max_tokens: int,
        max_tokens_limit: int | None,
        fetch_images: bool = False,
    ):
        """The context of the default (first) model."""
        name, model = next(iter(models.resident.items()))
        created = int(time.time())
        return cls(
            model.worker,
            name,
            default_max_tokens,
            models,
            created,
            max_tokens_limit,
            fetch_images=fetch_images,
        )

    @property
    def resident(self) -> ResidentModel:
        """This model's residency: loaded or not, its sizes and what it was found to hold."""
        return self.models.resident[self.model_name]

    @property
    def capabilities(self) -> Capabilities:
        """What this model can do with tools and thinking (`/api/show`, `/v1/models`), read
        from its template when it loaded; a model not loaded yet: from its tokenizer files
        (none known for one that is not a local directory)."""
        facts = self.resident.facts
        if facts is not None:
            return facts.capabilities
        before = self.resident.template_facts
        return _UNKNOWN if before is None else before.capabilities

    def each_model(self) -> list[ServerContext]:
        """One context per served model, the default first (for the listings)."""
        return [
            dataclasses.replace(self, worker=model.worker, model_name=name)
            for name, model in self.models.resident.items()
        ]


async def server_context(request: Request) -> ServerContext:
    """The context of the model the request names (`models.served.request_context`)."""
    return await request_context(request)


# A route parameter of this type receives the app's ServerContext.
Context = Annotated[ServerContext, Depends(server_context)]


def sse(data: dict[str, Any] | str, event: str | None = None) -> str:
    """One server-sent event; `data` as JSON unless it is already a string."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n"


class Generation(Protocol):
    """What a streamed response stops as it ends: a `reply.turn.Turn`, or a request's
    `reply.choices.Choices`."""

    def cancel(self) -> None: ...


def event_stream(
    events: AsyncIterator[str],
    turn: Generation,
    error_event: Callable[[ApiError], str],
    keepalive: str | None = SSE_KEEPALIVE,
    media_type: str = "text/event-stream",
) -> StreamingResponse:
    """A streamed response: server-sent events, or another line format (`media_type`, with
    `keepalive` None where the format has no way to say nothing: Ollama's NDJSON). `keepalive`
    (an SSE comment unless the API has its own ping event) goes out after every
    `KEEPALIVE_INTERVAL_S` without an event. A client that leaves cancels the turn at once; a
    generation that fails after the response has started ends the stream with
    `error_event(error)` (the API's own error event, typed as its status is) instead of a cut
    connection."""
    paced = events if keepalive is None else _with_keepalive(events, keepalive)
    guarded = guarded_events(paced, turn, error_event)
    return StreamingResponse(guarded, media_type=media_type, headers=SSE_HEADERS)


def replay_stream(events: AsyncIterator[str]) -> StreamingResponse:
    """Server-sent events of a generation another task reads (a background response's, read
    again): keep-alives while the next is slow; a client that leaves ends only its reading."""
    paced = _with_keepalive(events, SSE_KEEPALIVE)
    return StreamingResponse(paced, media_type="text/event-stream", headers=SSE_HEADERS)


async def guarded_events(
    events: AsyncIterator[str], turn: Generation, error_event: Callable[[ApiError], str]
) -> AsyncIterator[str]:
    """`events`, ended by `error_event(error)` where the generation fails after they began
    (the API's own error event, typed as its status is, instead of a cut stream); the turn is
    cancelled when they end, however they end (a reader that left)."""
    try:
        async for event in events:
            yield event
    except ApiError as error:  # refused once started (waited too long in the queue)
        yield error_event(error)
    except Exception as error:  # the status line is sent: say it in the stream
        logger.error("stream failed: %s", error)
        message = f"generation failed ({type(error).__name__}); see the server log"
        yield error_event(ApiError(500, message))
    finally:  # harmless after the end: the turn's cancel flag is its own
        turn.cancel()


async def _with_keepalive(events: AsyncIterator[str], keepalive: str) -> AsyncIterator[str]:
    """`events`, with `keepalive` between them whenever the next one takes longer than
    `KEEPALIVE_INTERVAL_S`. A reading task takes the events at most one ahead of the
    response (a client that stops reading still stalls its generation) and a timer armed once
    per interval, not per event, adds the keep-alives: a task and a timed wait per event cost
    the event loop, which serves every stream, about 40 us an event on this CPU, this 15.
    The pending read is never cancelled before the end: cancelling it closes the generation."""
    loop = asyncio.get_running_loop()
    interval_s = KEEPALIVE_INTERVAL_S
    handoff: asyncio.Queue[Any] = asyncio.Queue(maxsize=1)
    last_s = loop.time()  # when the last event (or keep-alive) was handed over

    async def hand_over(event: Any) -> None:
        nonlocal last_s
        await handoff.put(event)
        last_s = loop.time()

    def tick() -> None:
        nonlocal last_s, timer
        idle_s = loop.time() - last_s
        if idle_s >= interval_s and handoff.empty():
            handoff.put_nowait(keepalive)
            last_s, idle_s = loop.time(), 0.0
        timer = loop.call_later(max(interval_s - idle_s, 0.0), tick)

    reader = asyncio.ensure_future(_read(events, hand_over))
    timer = loop.call_later(interval_s, tick)
    try:
        while (event := await handoff.get()) is not _END_OF_EVENTS:
            if isinstance(event, _Raised):
                raise event.error
            yield event
    finally:  # the response was closed early (a client that left): end the read too
        timer.cancel()
        if not reader.done():
            reader.cancel()


_END_OF_EVENTS = object()  # handed over after the last event


@dataclass(frozen=True)
class _Raised:
    """What reading the events raised, handed over in their place."""

    error: Exception


T = TypeVar("T")


async def _read(events: AsyncIterator[Any], hand_over: Callable[[Any], Awaitable[None]]) -> None:
    """Hands over each of `events`, then `_END_OF_EVENTS`; what reading them raises is handed
    over as `_Raised` (raised where the response reads it). `events` is closed however the
    read ends (cancelled while handing over, it would be left open until collected)."""
    async with contextlib.aclosing(events):
        try:
            async for event in events:
                await hand_over(event)
        except Exception as error:
            await hand_over(_Raised(error))
            return
    await hand_over(_END_OF_EVENTS)


async def interleaved(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Each stream's items with its index, as they come (a request's choices). One stream is
    read as it is; several by a task each (`_read`). Leaving early, or a stream that fails,
    ends every read (closing their streams); the failure is raised."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    handoff: asyncio.Queue[tuple[int, Any]] = asyncio.Queue(maxsize=len(streams))

    def hand_over(index: int) -> Callable[[Any], Awaitable[None]]:
        return lambda item: handoff.put((index, item))

    readers = [
        asyncio.ensure_future(_read(stream, hand_over(index)))
        for index, stream in enumerate(streams)
    ]
    try:
        reading = len(readers)
        while reading:
            index, item = await handoff.get()
            if item is _END_OF_EVENTS:
                reading -= 1
            elif isinstance(item, _Raised):
                raise item.error
            else:
                yield index, item
    finally:
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)


V = TypeVar("V")


def json_chars(value: Any) -> int:
    """`value`'s size as `BoundedMap`'s callers measure it: characters of its JSON."""
    return len(json.dumps(value, ensure_ascii=False))


class BoundedMap(Generic[V]):
    """Entries an API keeps for later requests, in memory under a count and a size bound (its
    callers measure sizes in characters of JSON), the least recently used dropped first. An
    entry larger than the whole bound is not kept, and one that would grow past it does not
    grow, so the newest entry always fits and the bound always holds.

    Args:
        max_entries: the most entries kept.
        max_chars: the most characters all of them take.
        dropped: told of each entry dropped (evicted or popped), under the map's lock.
    """

    def __init__(
        self, max_entries: int, max_chars: int, dropped: Callable[[V], None] | None = None
    ):
        self.max_chars = max_chars
        self._max_entries = max_entries
        self._dropped = dropped
        self._entries: OrderedDict[str, tuple[V, int]] = OrderedDict()  # value, its chars
        self._chars = 0
        self._lock = threading.Lock()

    @property
    def chars(self) -> int:
        return self._chars

    def get(self, key: str) -> V | None:
        """The entry, marked as just used; None when not kept."""
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                return None
            self._entries.move_to_end(key)
            return found[0]

    def chars_of(self, key: str) -> int:
        with self._lock:
            return self._entries[key][1] if key in self._entries else 0

    def put(self, key: str, value: V, chars: int) -> bool:
        """Keeps `value` (of `chars` characters); False, keeping nothing, when it alone would
        pass the bound."""
        if chars > self.max_chars:
            return False
        with self._lock:
            self._discard(key)
            self._entries[key] = (value, chars)
            self._chars += chars
            self._evict()
        return True

    def grow(self, key: str, chars: int) -> bool:
        """Counts `chars` more (fewer, if negative) for the entry, marked as just used; False,
        changing nothing, when it is not kept or would pass the bound alone."""
        with self._lock:
            found = self._entries.get(key)
            if found is None or found[1] + chars > self.max_chars:
                return False
            self._entries[key] = (found[0], found[1] + chars)
            self._entries.move_to_end(key)
            self._chars += chars
            self._evict()
        return True

    def pop(self, key: str) -> V | None:
        with self._lock:
            found = self._entries.get(key)
            self._discard(key)
        return None if found is None else found[0]

    def _discard(self, key: str) -> None:
        found = self._entries.pop(key, None)
        if found is not None:
            self._chars -= found[1]
            if self._dropped is not None:
                self._dropped(found[0])

    def _evict(self) -> None:
        while len(self._entries) > self._max_entries or self._chars > self.max_chars:
            self._discard(next(iter(self._entries)))
