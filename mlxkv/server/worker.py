"""The bridge between asyncio request handlers and the Runner's blocking generations.

Owns: `GenerationWorker`, which starts generations in the order requests arrived, up to the
Runner's `max_batch` at once (more wait their turn), and `GenerationStream`, which hands a
generation's chunks to the event loop and cancels the generation when its consumer leaves.
Does not own the HTTP formats (each API's folder), batching (the Runner's batched streams
decode together on its engine thread) or cache policy (the Runner).

Each running generation has a thread of its own here that reads its chunks (a batched stream
is read by one thread, start to end); the model work itself runs on the Runner's engine thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from starlette.concurrency import run_in_threadpool

from mlxkv.errors import GrammarError, RanksOutOfStepError
from mlxkv.runner.results import Completion, GenerationChunk, PromptUsage
from mlxkv.runner.runner import Runner
from mlxkv.server.errors import ApiError
from mlxkv.server.middleware import SHUTTING_DOWN

logger = logging.getLogger(__name__)

_END = object()  # put on a stream's queue after its last chunk
# A consumer that has left this many chunks unread for this long has stopped reading (a
# client that holds its connection open and reads nothing): its generation is cancelled
# rather than held running while the others wait.
STALLED_CHUNKS = 64
STALLED_READER_S = 30.0
# The longest a generation waits for the event loop to send its first chunk before it
# computes the next (a loop that cannot send it sooner is not waited for any longer).
FIRST_CHUNK_HANDOFF_S = 0.25


class _LoopClosed(Exception):
    """The event loop a stream delivers to has closed (the server shut down)."""


class GenerationStream:
    """The chunks of one generation, as an async iterator on the event loop.

    Leaving the iteration early, or `cancel()`, ends the generation within one prefill chunk
    or decode step; the Runner keeps its cache consistent either way. So does a consumer that
    stops reading (`STALLED_CHUNKS` unread for `STALLED_READER_S`), and a generation that
    waited longer than `queue_timeout_s` for its turn ends with a 503 instead of starting.
    """

    def __init__(
        self,
        chunks: Iterator[GenerationChunk] | None,
        cancel: threading.Event,
        queue_timeout_s: float | None = None,
        closing: threading.Event | None = None,
    ):
        self._chunks = chunks
        self._cancel = cancel
        self._closing = closing or threading.Event()
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._queue_timeout_s = queue_timeout_s
        # Chunks handed over and read: written by one thread each, read by the other.
        self._delivered = self._read = 0
        self._last_read = time.monotonic()
        # The Completion once the generation has ended, however it ended (None if it failed
        # or never started); set even when the consumer left early.
        self.finished: asyncio.Future[Completion | None] = self._loop.create_future()
        # The prompt's usage once the cache is matched, before the prefill (`note_matched`);
        # None if the generation ended before (failed, cancelled while it waited).
        self.matched: asyncio.Future[PromptUsage | None] = self._loop.create_future()
        # What ends its wait for a turn after `queue_timeout_s` (`GenerationWorker.start`).
        self.deadline: asyncio.TimerHandle | None = None
        self._state = threading.Lock()
        self._started = self._abandoned = False
        # Set once the loop has taken the first chunk, or nobody will (cancelled, left).
        self._first_taken = threading.Event()

    def keep_queued(self) -> None:
        """No deadline for its turn (`queue_timeout_s`): nobody waits for this generation (a
        background response's), which waits as long as it takes."""
        if self.deadline is not None:
            self.deadline.cancel()

    def attach(self, chunks: Iterator[GenerationChunk]) -> None:
        """Gives a stream made before its generation (None then) the generation's chunks,
        before `pump` runs."""
        self._chunks = chunks

    def cancel(self) -> None:
        """Ends the generation (from any thread). One that has not started is finished at
        once: its place in the queue is free again, so a client that sends requests and
        leaves at once cannot fill the queue with work that will never be read."""
        self._cancel.set()
        self._first_taken.set()
        with self._state:
            if self._started or self._abandoned:
                return
            self._abandoned = True
        with contextlib.suppress(_LoopClosed):
            self._call(self._settle, None)
            self._call(self._queue.put_nowait, _END)  # a reader waiting (a non-streamed reply)

    def pump(self) -> None:
        """Runs the generation on the worker thread, passing each chunk to the loop."""
        with self._state:
            if self._abandoned:  # cancelled while it waited: nothing to run
                self._chunks.close()
                return
            self._started = True
        completion = None
        try:
            if self._closing.is_set():  # a stop signal came while it was being built
                raise ApiError(503, SHUTTING_DOWN)
            for chunk in self._chunks:
                if self._closing.is_set():  # the Runner's cancel missed one begun after it
                    self._cancel.set()
                completion = chunk.completion or completion
                cut = completion is not None and completion.finish_reason == "cancelled"
                if cut and self._closing.is_set():  # a reply that ended by itself still ends
                    raise ApiError(503, "the server is shutting down; this reply was cut short")
                self._deliver(chunk)
                if self._delivered == 1:
                    self._hand_over_first()
                if self._stalled():
                    logger.warning("a client stopped reading its stream; its generation ends")
                    self.cancel()
            self._deliver(_END)
        except _LoopClosed:  # the server shut down: stop generating
            pass
        except ApiError as error:
            with contextlib.suppress(_LoopClosed):
                self._deliver(error)
        except GrammarError as error:  # the client's schema, given up on mid-reply: a 400
            logger.warning("a request's grammar could not be followed: %s", error)
            with contextlib.suppress(_LoopClosed):
                self._deliver(ApiError(400, str(error)))
        except RanksOutOfStepError as error:  # said in the log once, where it happened
            with contextlib.suppress(_LoopClosed):
                self._deliver(ApiError(503, str(error)))
        except Exception as error:
            logger.exception("generation failed")
            with contextlib.suppress(_LoopClosed):
                self._deliver(error)
        finally:
            # Ends the Runner's generator here, on its consumer's thread, however the loop
            # ended: left suspended, it would hold this thread as its reader and the next
            # generation on it would be refused (RunnerBusyError).
            self._chunks.close()
            with contextlib.suppress(_LoopClosed):
                self._call(self._settle, completion)

    def expire(self) -> None:
        """On the event loop, when the wait for a turn has run out: a generation that has not
        started ends now with a 503 (its client hears it at once, not when its turn comes)."""
        with self._state:
            if self._started or self._abandoned:
                return
            self._abandoned = True
        self._cancel.set()
        self._queue.put_nowait(
            ApiError(
                503,
                f"the request waited {self._queue_timeout_s:.0f} s for its turn; the server "
                "is busy, try again later",
            )
        )
        self._settle(None)

    def _hand_over_first(self) -> None:
        """Waits (a bounded time) until the loop has handled the first chunk (sent its event),
        before the generation goes on: the next decode step would hold the GIL and the cores
        while the loop waits for them to send the first event (about 10 ms of a cached turn's
        25 on 2 CPU cores). Once: the steps after it still overlap the loop's sending."""
        self._first_taken.wait(FIRST_CHUNK_HANDOFF_S)

    def _deliver(self, item: Any) -> None:
        self._delivered += 1
        self._call(self._queue.put_nowait, item)

    def _stalled(self) -> bool:
        unread = self._delivered - self._read
        return unread > STALLED_CHUNKS and time.monotonic() - self._last_read > STALLED_READER_S

    def _call(self, function: Any, *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(function, *args)
        except RuntimeError as error:  # asyncio's "Event loop is closed"
            raise _LoopClosed from error

    def note_matched(self, usage: PromptUsage) -> None:
        """`Runner.stream`'s `matched` (on the engine thread): hands `usage` to the loop."""
        with contextlib.suppress(_LoopClosed):  # the server shut down: nobody to tell
            self._call(self._settle_matched, usage)

    def _settle_matched(self, usage: PromptUsage | None) -> None:
        if not self.matched.done():
            self.matched.set_result(usage)

    def _settle(self, completion: Completion | None) -> None:
        self._settle_matched(None)  # a no-op once matched
        if not self.finished.done():
            self.finished.set_result(completion)

    async def __aiter__(self) -> AsyncIterator[GenerationChunk]:
        finished = False
        try:
            while True:
                if self._read == 1:  # the first chunk's event is sent: the generation goes on
                    self._first_taken.set()
                item = await self._queue.get()
                self._read += 1
                self._last_read = time.monotonic()
                if item is _END:
                    finished = True
                    return
                if isinstance(item, Exception):
                    finished = True
                    raise item
                yield item
                if item.completion is not None:
                    # The reply is whole: the request's end on the engine (its entry kept,
                    # the budget, the memory line) is not the client's to wait for; a stream
                    # waiting for it would send a keep-alive after its API's last event.
                    finished = True
                    return
        finally:
            self._first_taken.set()
            if not finished:  # the consumer left (a client that went away): stop the work
                self.cancel()


class GenerationWorker:
    """Runs a Runner's generations as batched streams, up to `runner.max_batch` at once, first
    come first served.

    Args:
        runner: the loaded model and its cache; nothing else should generate with it.
    """

    def __init__(
        self, runner: Runner, max_queue: int | None = None, queue_timeout_s: float | None = None
    ):
        self.runner = runner
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self._executor = ThreadPoolExecutor(
            max_workers=runner.max_batch, thread_name_prefix="mlxkv-generate"
        )
        self._pending = 0  # generations accepted and not finished (event loop only)
        self._closing = threading.Event()

    def check_places(self, num_places: int) -> None:
        """Raises:
        ApiError: 400 for more generations at once (a request's choices, `n`) than
            `max_queue`: they could never fit (a 429 would say to retry)."""
        if self.max_queue is not None and num_places > self.max_queue:
            message = (
                f"this request asks for {num_places} generations (n for each prompt), over the "
                f"{self.max_queue} this server runs or queues at once (mlxkv serve --max-queue)"
            )
            raise ApiError(400, message, param="n")

    def hold_places(self, num_places: int) -> Places:
        """Places in the queue for the generations one request is about to start (its
        choices), held at once: requests that arrived together each took a part of the queue
        one start at a time, and all of them failed where some would have fit.

        Raises:
            ApiError: 400 as `check_places`, 429 when they do not fit now.
        """
        self.check_places(num_places)
        self._check_room(num_places)
        self._pending += num_places
        return Places(self, num_places)

    def _check_room(self, num_places: int) -> None:
        if self.max_queue is not None and self._pending + num_places > self.max_queue:
            needs = "" if num_places == 1 else f"; this request needs {num_places}"
            raise ApiError(
                429,
                f"{self._pending} generations are running or waiting (the limit is "
                f"{self.max_queue}{needs}); try again shortly",
                code="rate_limit_exceeded",
                headers={"Retry-After": "5"},
            )

    async def start(
        self, prompt: Any, places: Places | None = None, **options: Any
    ) -> GenerationStream:
        """Validates and queues a generation (`Runner.stream` arguments), in one of `places`
        if given.

        Raises:
            ApiError: 429 when `max_queue` generations are already running or waiting (never
                with `places`: held already).
            ApiError: 503 once the server is stopping (`begin_shutdown`).
            ValueError, ContextLengthError: bad input, before anything is queued.
        """
        if self._closing.is_set():
            raise ApiError(503, SHUTTING_DOWN)
        if places is not None:
            places.take()
        else:
            self._check_room(1)
            self._pending += 1
        cancel = threading.Event()
        stream = GenerationStream(None, cancel, self.queue_timeout_s, self._closing)

        def build_and_start() -> None:
            """Encoding and fitting may take a while for a long prompt: off the event loop.
            The generation starts from this thread, not after the loop has taken its turn
            back (about 1 ms of a cached turn on 2 loaded cores)."""
            chunks = self.runner.stream(
                prompt, cancel=cancel, batched=True, matched=stream.note_matched, **options
            )
            stream.attach(chunks)
            self._executor.submit(stream.pump)

        try:
            await run_in_threadpool(build_and_start)
        except BaseException:  # bad input, or the request went away meanwhile
            stream.cancel()
            self._pending -= 1
            raise
        stream.finished.add_done_callback(self._finished)
        if self.queue_timeout_s is not None:
            timer = asyncio.get_running_loop().call_later(self.queue_timeout_s, stream.expire)
            stream.finished.add_done_callback(lambda _: timer.cancel())
            stream.deadline = timer
        return stream

    def _finished(self, _: asyncio.Future) -> None:
        self._pending -= 1

    def begin_shutdown(self) -> None:
        """Ends every generation running or waiting now (from any thread): each stream ends
        with its API's error event (503, shutting down) rather than being cut later."""
        self._closing.set()
        self.runner.cancel()

    def shutdown(self) -> None:
        """Cancels what is running or waiting and waits for the worker threads to end."""
        self.runner.cancel()
        self._executor.shutdown(wait=True, cancel_futures=False)


class Places:
    """Places held in a worker's queue (`GenerationWorker.hold_places`): each generation
    started takes one; `release` gives back those not taken."""

    def __init__(self, worker: GenerationWorker, num_places: int):
        self._worker = worker
        self._left = num_places

    def take(self) -> None:
        if not self._left:
            raise RuntimeError("no place left: hold one more")
        self._left -= 1

    def release(self) -> None:
        self._worker._pending -= self._left
        self._left = 0
