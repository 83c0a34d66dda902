"""SIGTERM (`kill`, systemd, `docker stop`) in the `mlxkv` command: raised where the program
is, as Ctrl-C is, so that cleanups run, and the process then dies by it (`main`). Python's
default ends the process at once, which left a conversion's 257 MB temporary directory
behind.

A raise can be lost: landing in a `__del__`, a weakref callback or an asyncio callback,
Python prints "Exception ignored" and goes on (a `mlxkv serve` sent SIGTERM as it printed its
ready line kept serving). So the signal is also kept: `main` ends by it once the command
returns, and the server, whose own handler only sets a flag (which nothing can lose), is
told of one received before it took over (`stopped_by`).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from typing import Any

# SIGTERMs received, kept by the handlers (run in the main thread; no lock: a signal landing
# inside a handler that held one would deadlock it)
_received: set[int] = set()


class Terminated(BaseException):
    """SIGTERM, raised where the main thread is."""


def raise_terminated(signum: int, frame: object) -> None:
    _received.add(signal.SIGTERM)
    raise Terminated


@contextlib.contextmanager
def terminated_by_raising() -> Iterator[None]:
    """SIGTERM raises `Terminated` inside (one received before, from an earlier command in
    this process, is forgotten)."""
    _received.clear()
    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def raise_if_terminated() -> None:
    """Raises `Terminated` for a SIGTERM received whose raise was lost."""
    if _received:
        raise Terminated


@contextlib.contextmanager
def stopped_by(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """SIGINT and SIGTERM call `handler` (uvicorn's `handle_exit`) inside; a SIGTERM received
    before, and lost, calls it at once. A SIGTERM is kept too: one that comes once the server
    has stopped, as it shuts down, still ends the command (`main`)."""

    def handle(signum: int, frame: Any) -> None:
        if signum == signal.SIGTERM:
            _received.add(signum)
        handler(signum, frame)

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if _received:
            handler(signal.SIGTERM, None)
        yield
    finally:
        for sig, restored in previous.items():
            signal.signal(sig, restored)
