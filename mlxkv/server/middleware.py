"""ASGI middleware: the access log, server errors, the API key and the request body.

Plain ASGI (not Starlette's BaseHTTPMiddleware), so streamed responses pass through untouched
and a client that disconnects is still seen by the route.

Owns: `AccessLog` (one line per request: method, path, status, seconds, for a refusal (4xx) its
reason, and for generations the prompt, cached and generated tokens, time to first token and
the cache's memory line), `ServerErrors` (a 500 in the API's shape for what no handler took),
`ApiKeyCheck` (401 without the key), `BodyDeadline` (one deadline for a request's body; the
unread rest of a body read before any answer sent ahead of it) and `BodyLimit` (413 over the
limit in bytes, 400 for JSON nested too deeply; every body is then read as JSON whatever its
Content-Type). What a web page may reach is `browsers.py`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import time
from collections.abc import Callable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlxkv.server.errors import error_response
from mlxkv.server.json_limits import (
    MAX_JSON_DEPTH,
    MAX_JSON_VALUES,
    json_shape,
    too_deep_message,
    too_many_message,
)

logger = logging.getLogger("mlxkv.server.access")
_errors = logging.getLogger(__name__)

# Answered without the API key: /health for load balancers and scripts; the chat page and its
# files hold no data (the page asks for the key and sends it with its API calls).
_OPEN_PATHS = ("/health", "/")
_OPEN_PREFIXES = ("/static/",)
# Control characters, and the two Unicode line breaks Python's splitlines() also splits at.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# How much of a refusal's body is read for its reason, and how much of the reason is logged.
_MAX_REFUSAL_BYTES = 4096
_MAX_REASON_CHARS = 300
# Seconds a request body may take to arrive once its headers have, read or drained (a slow
# sender holds a connection and, here, a task): one budget per request.
BODY_TIMEOUT_S = 120.0
# What a request cut by the server's stop (its graceful wait ran out) is told.
SHUTTING_DOWN = "the server is shutting down; send the request again once it is back"
# Bytes of a body still read (and dropped) before an answer that came before it was read:
# answered first, the connection closed under a client still sending (one that sent
# `Connection: close`, as urllib does), which saw a reset instead. Past this, answered at once.
_MAX_DRAINED_BYTES = 64 * 2**20


def seconds_since_arrival(scope: Scope) -> float:
    """Seconds since `AccessLog` (the outermost check) saw the request: a wait before the
    route runs (a model loading) included; 0.0 for a request it did not see."""
    arrived_s = scope.get("state", {}).get("arrived_s")
    return 0.0 if arrived_s is None else time.perf_counter() - arrived_s


class AccessLog:
    """Logs one INFO line per HTTP request when the response ends, and stamps its arrival
    (`seconds_since_arrival`).

    Args:
        memory_line: the memory line of the request's model (given its scope), appended
            after a generation.
    """

    def __init__(self, app: ASGIApp, memory_line: Callable[[Scope], str]):
        self.app = app
        self.memory_line = memory_line

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status, refusal = time.perf_counter(), [0], bytearray()
        scope.setdefault("state", {})["arrived_s"] = start

        async def record(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif 400 <= status[0] < 500 and len(refusal) < _MAX_REFUSAL_BYTES:
                refusal.extend(message.get("body", b"")[:_MAX_REFUSAL_BYTES])
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            # escaped: a %0a in the path would otherwise start a forged log line
            line = (
                f"{printable(scope['method'])} {printable(scope['path'])} {status[0]}"
                f" {time.perf_counter() - start:.3f}s"
            )
            if refusal:
                line += f" reason={_reason(bytes(refusal))}"
            turn = scope.get("state", {}).get("turn")
            # A client that left early: its generation ends within a step of the cancel.
            completion = await turn.finished() if turn is not None else None
            if completion is not None:
                # cancelled in its prefill: no first token, no time to it
                ttft = f"{completion.ttft:.3f}s" if completion.generation_tokens else "none"
                line += (
                    f" prompt={completion.prompt_tokens} cached={completion.cached_tokens}"
                    f" generated={completion.generation_tokens} ttft={ttft}"
                    f" finish={completion.finish_reason}"
                )
                if completion.drafted_tokens:  # speculative decoding's acceptance
                    share = completion.accepted_tokens / completion.drafted_tokens
                    line += (
                        f" drafted={completion.drafted_tokens}"
                        f" accepted={completion.accepted_tokens} ({share:.0%})"
                    )
                line += f" | {self.memory_line(scope)}"
            logger.info("%s", line)


def _reason(body: bytes) -> str:
    """A refusal's message, from the body of any API's error shape, quoted and bounded: a
    client that hides the body (LiteLLM, agents retrying) leaves the log to say why."""
    try:
        parsed = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        parsed = body.decode("utf-8", "replace")
    error = parsed.get("error", parsed) if isinstance(parsed, dict) else parsed
    message = error.get("message", error) if isinstance(error, dict) else error
    text = printable(str(message))
    if len(text) > _MAX_REASON_CHARS:
        text = text[: _MAX_REASON_CHARS - 3] + "..."
    return json.dumps(text, ensure_ascii=False)


def printable(text: str) -> str:
    """`text` with control characters escaped: a log line cannot be forged through it."""
    return _UNPRINTABLE.sub(lambda m: ascii(m.group())[1:-1], text)


class ServerErrors:
    """Turns an exception no handler took into a 500 in the API's shape, logged once with its
    traceback. Left to Starlette's outermost handler, it was answered and raised again: logged
    twice (the second time by uvicorn), and the access log, which it passed through, showed
    status 0. A request uvicorn cancels at the end of its graceful shutdown (one that never
    reached a worker, which ends its own at the stop signal: an image being fetched, a model
    being loaded) is answered 503 when nothing was sent yet; uvicorn logged its
    CancelledError as "Exception in ASGI application" with a traceback."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except asyncio.CancelledError:
            if started:
                raise
            await error_response(scope, 503, SHUTTING_DOWN)(scope, receive, send)
        except Exception as error:
            _errors.exception(
                "request failed: %s %s", printable(scope["method"]), printable(scope["path"])
            )
            if not started:  # else the client sees the connection end
                message = f"internal error ({type(error).__name__}); the server log has the details"
                await error_response(scope, 500, message)(scope, receive, send)


class ApiKeyCheck:
    """Requires `Authorization: Bearer KEY` (OpenAI clients) or `x-api-key: KEY` (Anthropic
    clients) on every path but /health and the chat page's; CORS preflights pass."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] == "OPTIONS"
            or scope["path"] in _OPEN_PATHS
            or scope["path"].startswith(_OPEN_PREFIXES)
            or self._presented(scope)
        ):
            await self.app(scope, receive, send)
            return
        response = error_response(
            scope,
            401,
            "missing or wrong API key; send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await response(scope, receive, send)

    def _presented(self, scope: Scope) -> bool:
        headers = dict(scope["headers"])
        bearer = headers.get(b"authorization", b"")
        candidates = [headers.get(b"x-api-key", b"")]
        if bearer[:7].lower() == b"bearer ":
            candidates.append(bearer[7:].strip())
        return any(hmac.compare_digest(c, self._key) for c in candidates)


class BodyDeadline:
    """One deadline per request for its body, and the body's rest read before an early answer.

    The body must arrive within `BODY_TIMEOUT_S` of the request's headers, read and drained
    alike: a receive past the deadline raises TimeoutError (`BodyLimit` answers 408). A drain
    with a deadline of its own would hold an over-limit body dripped slowly for the read's
    120 s and then its own; nested in the read's, it answered that body 408, as if it had not
    come, instead of 413.

    An answer that starts before the body has been read (401, 403, 413, 408, a CORS
    preflight's) first reads and drops the rest of it, up to `_MAX_DRAINED_BYTES` and by the
    same deadline, as nginx's lingering close does: answered first, the connection closed
    under a client still sending that had asked to close it (urllib's `Connection: close`),
    which then saw a reset instead of the answer. Not drained: a client waiting for
    `100 Continue` (curl; it sends nothing until told), or one that declared more than
    `_MAX_DRAINED_BYTES`. Sits inside `ServerErrors`: a 503 at shutdown does not wait.
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline_s = asyncio.get_running_loop().time() + BODY_TIMEOUT_S
        body_ended = False

        async def receive_by_deadline() -> Message:
            nonlocal body_ended
            if body_ended:  # the route's wait for a disconnect has no deadline
                return await receive()
            async with asyncio.timeout_at(deadline_s):
                message = await receive()
            body_ended = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def send_after_body(message: Message) -> None:
            if message["type"] == "http.response.start" and not body_ended and _drainable(scope):
                await _drain(receive_by_deadline)
            await send(message)

        await self.app(scope, receive_by_deadline, send_after_body)


def _drainable(scope: Scope) -> bool:
    """Whether the rest of a body is worth reading: its client sends it (no `Expect`) and
    it fits `_MAX_DRAINED_BYTES` (one declared larger is answered at once)."""
    headers = dict(scope["headers"])
    declared = headers.get(b"content-length", b"")
    too_long = declared.isdigit() and int(declared) > _MAX_DRAINED_BYTES
    return b"expect" not in headers and not too_long


async def _drain(receive: Receive) -> None:
    """Reads and drops the rest of a body, up to `_MAX_DRAINED_BYTES` (a `receive` bounded
    by its request's deadline: stopped there too)."""
    drained = 0
    with contextlib.suppress(TimeoutError):
        while drained <= _MAX_DRAINED_BYTES:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                return
            drained += len(message.get("body", b""))


class BodyLimit:
    """Reads the whole request body first, refusing one larger than `max_bytes` with 413
    (declared by Content-Length or counted as it arrives), and one nested deeper than
    `json_limits.MAX_JSON_DEPTH` or holding more than `MAX_JSON_VALUES` values with 400,
    then hands it to the app. Its `receive` is `BodyDeadline`'s: one that does not arrive in
    time is a 408, and what a refused body still sends is read there."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and not declared.isdigit():
            await self._refuse(scope, receive, send, False)
            return
        if declared is not None and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send, True)
            return
        parts: list[bytes] = []
        size = 0
        try:
            while True:
                message = await receive()
                if message["type"] != "http.request":  # the client left before the end
                    return
                parts.append(message.get("body", b""))
                size += len(parts[-1])
                if size > self.max_bytes:
                    await self._refuse(scope, receive, send, True)
                    return
                if not message.get("more_body", False):
                    break
        except TimeoutError:
            message = f"the request body did not arrive within {BODY_TIMEOUT_S:.0f} s"
            await error_response(scope, 408, message)(scope, receive, send)
            return
        body = b"".join(parts)
        # tens of milliseconds per MB of structure: off the event loop for a large body
        shape = json_shape(body) if len(body) < 2**16 else await run_in_threadpool(json_shape, body)
        problem = None
        if shape.depth > MAX_JSON_DEPTH:
            problem = too_deep_message(shape.depth, "the request body")
        elif shape.values > MAX_JSON_VALUES:
            problem = too_many_message(shape.values)
        if problem is not None:
            await error_response(scope, 400, problem)(scope, receive, send)
            return
        await self.app(_as_json(scope, body), replay(body, receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, too_large: bool) -> None:
        if too_large:
            message = (
                f"request body is larger than this server's limit of {self.max_bytes:,} bytes;"
                " send less, or start the server with a larger --max-body-bytes"
            )
            response = error_response(scope, 413, message)
        else:
            response = error_response(scope, 400, "Content-Length is not a number")
        await response(scope, receive, send)


def _as_json(scope: Scope, body: bytes) -> Scope:
    """`scope` with a body's Content-Type set to JSON: Ollama's clients, LiteLLM's `ollama/`
    provider and `curl -d` send JSON without saying so (none, or a form's type), and Ollama
    reads it; FastAPI would read it as a form or bytes and answer 400. A page on another site
    cannot use this to reach the API: `browsers.OriginCheck` refuses its requests first."""
    if not body:
        return scope
    headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
    return {**scope, "headers": [*headers, (b"content-type", b"application/json")]}


def replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the buffered body once, then waits for the client's disconnect."""
    delivered = False

    async def replay() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
