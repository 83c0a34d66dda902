"""The server's connections as uvicorn runs them, with the limits a public port needs.

Owns `uvicorn_config` (the one place the server's uvicorn settings are chosen), `Server`
(uvicorn's server, stopping generations when told to stop), `GuardedH11Protocol` (uvicorn's
HTTP/1.1 protocol with a deadline for request headers), `OncePerKind` and `WithoutTraceback`
(log filters).
Seen before: ~2,100 sockets opened and left idle made the server unreachable (uvicorn waits
for headers forever) while the log grew 530 MB in 50 s, one line per failed accept.

Terms:
  - turned away: a connection closed because too many wait for their headers. It is answered
    503 first (before its request, as a server may answer 408), its bytes read and dropped
    until the client closes or `LINGER_S` passes: closed with a request unread, it would be
    reset, and a client of a burst (100 at once) saw "connection reset" instead of an answer.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import re
import sys
import termios
import time
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from mlxkv.config import ServerConfig
from mlxkv.server.errors import error_response

logger = logging.getLogger(__name__)

# Seconds a connection may take to send a request's headers (from opening, or from the first
# byte of a later request on a kept-alive connection).
HEADER_TIMEOUT_S = 15.0
# Connections still waiting for their headers, beyond which the oldest is turned away when
# another opens: idle sockets cannot fill the connection limit that requests need (256 of them
# made every request a 503 until the header deadline passed, and an attacker can reconnect).
MAX_WAITING_CONNECTIONS = 64
KEEP_ALIVE_S = 5
# Seconds a turned-away connection is kept to read its client's request (and drop it) after
# its 503, so that the close resets nothing; it no longer counts against the limits.
LINGER_S = 2.0
RETRY_AFTER_S = 1
# Files a server holds open besides its connections: the model's, the disk tier's reads and
# writes, the stored responses', logs and pipes.
FILES_BESIDE_CONNECTIONS = 128
_REQUEST_LINE = re.compile(rb"[A-Z]+ (/[^ ?\r\n]*)")
# Seconds the same kind of log line (uvicorn's, asyncio's) is shown once, then counted.
LOG_REPEAT_WINDOW_S = 60.0


class Server(uvicorn.Server):
    """uvicorn's server for an mlxkv app. On a stop signal the generations running or waiting
    end at once, each stream with its API's error event, instead of running on until uvicorn's
    graceful timeout cuts them mid-event (with a traceback in the log). The signals that
    stopped it are kept in `signals`: uvicorn would raise them again as soon as it has shut
    down, which for SIGTERM ends the process before the caller has saved the cache."""

    signals: tuple[int, ...] = ()

    async def shutdown(self, sockets: Any = None) -> None:
        """Closes the turned-away connections still lingering (they left uvicorn's count, so
        its shutdown does not see them), then shuts down as uvicorn does."""
        for connection in list(_lingering(self.server_state)):
            connection.transport.close()
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        context = getattr(getattr(self.config.app, "state", None), "mlxkv", None)
        if context is not None:
            context.models.residency.begin_shutdown()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            self.signals = tuple(self._captured_signals)
            self._captured_signals.clear()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, closing a connection whose request headers have not all
    arrived within `HEADER_TIMEOUT_S` (408 if it began a request; uvicorn's own keep-alive
    timeout only covers the wait after a response), and turning away the oldest of those
    waiting when over `MAX_WAITING_CONNECTIONS` wait at once (the oldest with nothing unread:
    a request already sent is served)."""

    _header_deadline: Any = None
    _turned_away = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # uvicorn answers a request over `limit_concurrency` in plain text, without
        # Retry-After: this protocol keeps the limit and answers it itself (`_over_limit`)
        self._max_open, self.limit_concurrency = self.limit_concurrency, None
        self._app = self.app

    def handle_events(self) -> None:
        """uvicorn's, serving a request that arrives over the limit with `_over_limit` (the
        counts uvicorn checks: no task starts before the request it reads here)."""
        limit = self._max_open
        over = limit is not None and max(len(self.connections), len(self.tasks)) >= limit
        self.app = self._over_limit if over else self._app
        super().handle_events()

    async def _over_limit(self, scope: Any, receive: Any, send: Any) -> None:
        """503 in the shape of the request's API, with Retry-After, as the server's own 503s;
        the connection closes after it."""
        logger.warning("answered 503: over %s connections were open", self._max_open)
        message = (
            f"the server has all the {self._max_open} connections it allows open; retry in "
            f"{RETRY_AFTER_S} s"
        )
        headers = {"Retry-After": str(RETRY_AFTER_S), "Connection": "close"}
        await error_response(scope, 503, message, headers=headers)(scope, receive, send)

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._turned_away:
            return  # answered already: read only so that the close resets nothing
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm()  # a request begun, its headers not complete yet
        else:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        _lingering(self.server_state).discard(self)
        super().connection_lost(exc)

    def _waiting(self) -> OrderedDict[GuardedH11Protocol, None]:
        """This server's connections waiting for headers, oldest first."""
        state = self.server_state
        if not hasattr(state, "mlxkv_waiting"):
            state.mlxkv_waiting = OrderedDict()
        return state.mlxkv_waiting

    def _arm(self) -> None:
        """Starts the header deadline, and bounds the connections waiting: also each time a
        waiting one is read (those skipped for their unread bytes are counted again then: a
        burst accepted before any was read left hundreds waiting)."""
        waiting = self._waiting()
        if self._header_deadline is None:
            self._header_deadline = self.loop.call_later(HEADER_TIMEOUT_S, self._too_slow)
            waiting[self] = None
        while len(waiting) > MAX_WAITING_CONNECTIONS:
            # one whose request has arrived but is not read yet is about to be served
            oldest = next((c for c in waiting if not c._has_unread_bytes()), None)
            if oldest is None:
                break
            logger.warning(
                "turned away a connection waiting for its headers: over %d waited at once",
                MAX_WAITING_CONNECTIONS,
            )
            oldest._turn_away()

    def _turn_away(self) -> None:
        """Answers 503 (Retry-After; in the shape of the API of the request line and header
        lines that came, if any) and closes once the client has closed or `LINGER_S` passed."""
        received, _ = self.conn.trailing_data
        message = (
            f"over {MAX_WAITING_CONNECTIONS} connections were waiting for their request "
            f"headers; retry in {RETRY_AFTER_S} s"
        )
        busy = error_response(
            _partial_scope(received), 503, message, headers={"Retry-After": str(RETRY_AFTER_S)}
        )
        head = b"HTTP/1.1 503 Service Unavailable\r\nconnection: close\r\n"
        head += b"".join(name + b": " + value + b"\r\n" for name, value in busy.raw_headers)
        self._answer_and_linger(head + b"\r\n" + busy.body)

    def _answer_and_linger(self, answer: bytes) -> None:
        """Writes `answer` (a whole response, before its request was read) and closes once the
        client has closed or `LINGER_S` has passed; the bytes it still sends are dropped."""
        self._disarm()
        self._turned_away = True
        self.transport.write(answer)
        if self.transport.can_write_eof():  # not over TLS: that close waits for the linger
            self.transport.write_eof()  # the client reads the answer, then its end of file
        self.connections.discard(self)  # lingering: not held against the connection limit
        _lingering(self.server_state).add(self)
        self.loop.call_later(LINGER_S, self.transport.close)

    def _has_unread_bytes(self) -> bool:
        """Whether bytes wait in this connection's socket: in a burst of connections, the
        event loop accepts them all before it reads a request sent just before them."""
        sock = self.transport.get_extra_info("socket")
        if sock is None or sock.fileno() < 0:  # closed
            return False
        unread = fcntl.ioctl(sock.fileno(), termios.FIONREAD, bytes(4))
        return int.from_bytes(unread, sys.byteorder) > 0

    def _disarm(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None
            self._waiting().pop(self, None)

    def _too_slow(self) -> None:
        """The header deadline: a connection that began a request is answered 408 (as nginx
        does; a client then reports a timeout, not a dropped connection), one that sent
        nothing is closed without a word (an idle socket, a port scanner)."""
        self._header_deadline = None
        self._waiting().pop(self, None)
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        logger.warning(
            "closed a connection whose request headers did not arrive within %.0f s",
            HEADER_TIMEOUT_S,
        )
        received, _ = self.conn.trailing_data
        if not received:
            self.transport.close()
            return
        message = f"the request headers did not arrive within {HEADER_TIMEOUT_S:g} s\n"
        self._answer_and_linger(
            b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\n"
            b"content-type: text/plain; charset=utf-8\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(message), message.encode())
        )


def _partial_scope(received: bytes) -> dict[str, Any]:
    """The path and the whole header lines of a request whose headers have not all arrived,
    as an ASGI scope has them (names lower-cased): enough for `error_response` to choose the
    API's shape as it does for a request read whole (`anthropic-version` on `/v1/models`)."""
    request_line, *lines = received.split(b"\r\n")
    match = _REQUEST_LINE.match(request_line)
    complete = lines[:-1]  # the line after the last CRLF may be cut short
    headers = [
        (name.strip().lower(), value.strip())
        for name, sep, value in (line.partition(b":") for line in complete)
        if sep
    ]
    return {"path": match.group(1).decode("ascii") if match else "/", "headers": headers}


def _lingering(state: Any) -> set[GuardedH11Protocol]:
    """The server's turned-away connections not closed yet (closed when it shuts down)."""
    if not hasattr(state, "mlxkv_lingering"):
        state.mlxkv_lingering = set()
    return state.mlxkv_lingering


class OncePerKind(logging.Filter):
    """Lets a kind of record (its logger and message template) through once per
    `LOG_REPEAT_WINDOW_S`; the next one shown says how many were held back."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: dict[tuple[str, str], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        kind = (record.name, str(record.msg))
        now = time.monotonic()
        shown_at, held = self._seen.get(kind, (-LOG_REPEAT_WINDOW_S, 0))
        if now - shown_at < LOG_REPEAT_WINDOW_S:
            self._seen[kind] = (shown_at, held + 1)
            return False
        if len(self._seen) > 1000:
            self._seen.clear()
        self._seen[kind] = (now, 0)
        if held:
            record.msg = f"{record.msg} ({held} more like it in the last minute)"
        return True


class WithoutTraceback(logging.Filter):
    """asyncio's record of an accept that failed at the open-file limit (which it retries a
    second later) as one line naming the error, not a traceback through asyncio's own code.
    Other records keep their traceback (an OSError of our own code is a bug to read)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, OSError) and str(record.msg).startswith("socket.accept()"):
            record.msg = f"{record.getMessage().splitlines()[0]}: {error}"
            record.args, record.exc_info, record.exc_text = (), None, None
        return True


_WITHOUT_TRACEBACK = WithoutTraceback()


def open_files_needed(config: ServerConfig) -> int:
    """The open files a server of `config` may need at once: every connection it lets open
    (`uvicorn_config`) and `FILES_BESIDE_CONNECTIONS`. Past the process's limit, accepting a
    connection and opening a disk-tier file both fail ("Too many open files")."""
    return config.max_connections + MAX_WAITING_CONNECTIONS + FILES_BESIDE_CONNECTIONS


def uvicorn_config(app: Any, config: ServerConfig, **options: Any) -> uvicorn.Config:
    """uvicorn's settings for `app`: the guarded protocol, `config.max_connections` open at
    once besides those still waiting for their headers (more get 503), a short keep-alive,
    and repeated lines of uvicorn's and asyncio's logs shown once per kind."""
    once = OncePerKind()
    logging.getLogger("asyncio").addFilter(_WITHOUT_TRACEBACK)  # once however many servers
    for name in ("uvicorn.error", "asyncio", __name__):
        logging.getLogger(name).addFilter(once)
    settings: dict[str, Any] = {
        "http": GuardedH11Protocol,
        "limit_concurrency": config.max_connections + MAX_WAITING_CONNECTIONS,
        "timeout_keep_alive": KEEP_ALIVE_S,
        "log_level": "warning",
        "access_log": False,
        **options,
    }
    return uvicorn.Config(app, **settings)
