"""Streams that start at once while their model loads: a streaming request for a model not
loaded yet gets its response headers and the API's keep-alive right away, as during a long
prefill, instead of nothing until the load ends (minutes for a large model: clients with a
first-byte timeout give up).

Owns `StreamShape` (how one API's stream starts and fails, given by each API folder) and
`StartStreams` (the middleware that starts such a response before the route runs). The route
itself is unchanged: it waits for the model in `served.request_context`, the one place a model
is acquired, then streams as usual; its own response start is dropped (already sent) and its
body follows. A route that answers with an error instead (the load failed, a 400 on its input)
ends the stream with the API's error event, as an error during a stream does. A request that
does not stream, or whose model is loaded, passes through untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlxkv.server import state
from mlxkv.server.errors import ApiError
from mlxkv.server.middleware import SHUTTING_DOWN, replay
from mlxkv.server.models.served import ServedModels, body_object, named_model
from mlxkv.server.state import SSE_HEADERS


@dataclass(frozen=True)
class StreamShape:
    """Attributes:
    error_event: the API's stream error event for an error.
    keepalive: what the API sends while nothing else comes (None: nothing, Ollama's NDJSON).
    media_type: the stream's content type.
    streams_by_default: a body without `stream` streams (Ollama's chat and generate).
    """

    error_event: Callable[[ApiError], str]
    keepalive: str | None = ": keep-alive\n\n"
    media_type: str = "text/event-stream"
    streams_by_default: bool = False


class StartStreams:
    """ASGI middleware: a streaming request (`shapes` by path) for a served model not loaded
    yet starts its response before the route waits for the load (`served.request_context`).
    Its keep-alive goes out at once and every `state.KEEPALIVE_INTERVAL_S` (read each time, as
    the route's own pacing reads it) until the route starts its own stream."""

    def __init__(self, app: ASGIApp, models: ServedModels, shapes: Mapping[str, StreamShape]):
        self.app = app
        self.models = models
        self.shapes = shapes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        shape = self.shapes.get(scope.get("path", "")) if scope["type"] == "http" else None
        if shape is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        message = await receive()  # the whole body: `BodyLimit` has read it already
        body = message.get("body", b"")
        receive = replay(body, receive)
        if not self._loads_first(body_object(body), shape):
            await self.app(scope, receive, send)
            return
        await _Early(shape, send).run(self.app, scope, receive)

    def _loads_first(self, body: dict[str, Any], shape: StreamShape) -> bool:
        """Whether the request streams and names a model that is not loaded now."""
        if body.get("stream", shape.streams_by_default) is not True:
            return False
        try:
            name = self.models.resolve(named_model(body))
        except ApiError:  # the route answers the 404
            return False
        return self.models.resident[name].worker is None


class _Early:
    """One response started ahead of its route: keep-alives until the route's own stream."""

    def __init__(self, shape: StreamShape, send: Send):
        self.shape = shape
        self._send = send
        self._lock = asyncio.Lock()  # a keep-alive is never cut by the route's first bytes
        self._pacer: asyncio.Task | None = None
        self._error: bytearray | None = None  # the route's error body, as it arrives
        self._error_status = 500  # the route's error status
        self._ended = False

    async def run(self, app: ASGIApp, scope: Scope, receive: Receive) -> None:
        headers = [(b"content-type", self.shape.media_type.encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in SSE_HEADERS.items()]
        await self._send({"type": "http.response.start", "status": 200, "headers": headers})
        if self.shape.keepalive is not None:
            await self._body(self.shape.keepalive.encode())
            self._pacer = asyncio.create_task(self._pace(self.shape.keepalive.encode()))
        try:
            await app(scope, receive, self._from_route)
        except asyncio.CancelledError:  # a stop signal's graceful wait ran out (a long load)
            await self._stop_pacing()
            if self._ended:
                raise
            await self._end(
                ApiError(503, SHUTTING_DOWN)
            )  # ended whole: no traceback of the cancel to log
        except Exception as error:  # the status line is sent: say it in the stream
            await self._stop_pacing()
            if not self._ended:
                name = type(error).__name__
                await self._end(ApiError(500, f"the request failed ({name}); see the server log"))
            raise
        finally:
            await self._stop_pacing()

    async def _pace(self, keepalive: bytes) -> None:
        while True:
            await asyncio.sleep(state.KEEPALIVE_INTERVAL_S)
            async with self._lock:
                await self._body(keepalive)

    async def _stop_pacing(self) -> None:
        if self._pacer is not None:
            async with self._lock:  # not while a keep-alive is being sent
                self._pacer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pacer
            self._pacer = None

    async def _from_route(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            await self._stop_pacing()
            if message["status"] >= 400:
                self._error = bytearray()
                self._error_status = message["status"]
            return
        if message["type"] != "http.response.body":
            await self._send(message)
            return
        if self._error is None:
            self._ended = not message.get("more_body", False)
            await self._send(message)
            return
        self._error += message.get("body", b"")
        if not message.get("more_body", False):
            await self._end(_parsed_error(self._error_status, bytes(self._error)))

    async def _end(self, error: ApiError) -> None:
        self._ended = True
        await self._body(self.shape.error_event(error).encode(), more=False)

    async def _body(self, data: bytes, more: bool = True) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": more})


def _parsed_error(status: int, body: bytes) -> ApiError:
    """The error of a response in any API's shape (`errors.error_response`), with its status
    (and OpenAI's code and param), so the stream's event is typed as the response was."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return ApiError(status, body.decode(errors="replace"))
    error = parsed.get("error", parsed) if isinstance(parsed, dict) else parsed
    if not isinstance(error, dict):
        return ApiError(status, str(error))
    code, param = error.get("code"), error.get("param")
    return ApiError(status, str(error.get("message", error)), code=code, param=param)
