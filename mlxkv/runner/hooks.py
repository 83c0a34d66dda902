"""Watching requests end: the public end-of-request hook.

Owns `RequestEnd` (what a request left behind as its entry was released) and `request_ends`,
which has an observer told of every request's end, in every Runner of the process, while its
block runs: a trace, a metric, or the test suite's check that an entry holds exactly what its
request fed. Observers run on the engine thread right after the release, before the request's
last chunk reaches its caller, so they may run the model on the entry; one that raises fails
that request. Does not own the release itself (`mlxkv.runner.request_run.run_request`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlxkv.runner.prompt_cache.entry import CacheEntry
    from mlxkv.runner.run_context import RunContext


@dataclass(frozen=True, kw_only=True)
class RequestEnd:
    """A request's end.

    Attributes:
        entry: the entry it generated into, released (its tokens and bytes recorded).
        prompt: the token ids of its (fitted) prompt.
        generated: the token ids it streamed, in order.
        images: the prompt's images (`mlxkv.models.vision.ImageSpan`s), none for text.
        context: the Runner's model, pool and settings it ran with.
    """

    entry: CacheEntry
    prompt: list[int]
    generated: list[int]
    images: tuple = ()
    context: RunContext


_observers: list[Callable[[RequestEnd], None]] = []
_lock = threading.Lock()


@contextlib.contextmanager
def request_ends(observer: Callable[[RequestEnd], None]) -> Iterator[None]:
    """Tells `observer` of every request's end while the block runs."""
    with _lock:
        _observers.append(observer)
    try:
        yield
    finally:
        with _lock:
            _observers.remove(observer)


def notify(end: RequestEnd) -> None:
    """Tells every observer registered now of `end` (on the engine thread)."""
    with _lock:
        observers = list(_observers)
    for observer in observers:
        observer(end)
