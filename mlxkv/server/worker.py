"""The bridge between asyncio request handlers and the Runner's blocking generations.

Owns: `GenerationWorker`, one thread that runs every generation in the order requests
arrived, and `GenerationStream`, which hands a generation's chunks to the event loop and
cancels the generation when its consumer leaves. Does not own the HTTP formats (`openai`,
`anthropic`) or cache policy (the Runner).

Why one dedicated thread: MLX ties lazy arrays to the stream of the thread that built them, so
a generation must run start to end on one thread (a thread pool that resumes a generator on
any free thread breaks that); and one thread gives the requests' first-come-first-served order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from starlette.concurrency import run_in_threadpool

from mlxkv.engine.results import Completion, GenerationChunk
from mlxkv.engine.runner import Runner

logger = logging.getLogger(__name__)

_END = object()  # put on a stream's queue after its last chunk


class _LoopClosed(Exception):
    """The event loop a stream delivers to has closed (the server shut down)."""


class GenerationStream:
    """The chunks of one generation, as an async iterator on the event loop.

    Leaving the iteration early, or `cancel()`, ends the generation within one prefill chunk
    or decode step; the Runner keeps its cache consistent either way.
    """

    def __init__(self, chunks: Iterator[GenerationChunk], cancel: threading.Event):
        self._chunks = chunks
        self._cancel = cancel
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        # The Completion once the generation has ended, however it ended (None if it failed);
        # set even when the consumer left early.
        self.finished: asyncio.Future[Completion | None] = self._loop.create_future()

    def cancel(self) -> None:
        self._cancel.set()

    def pump(self) -> None:
        """Runs the generation on the worker thread, passing each chunk to the loop."""
        completion = None
        try:
            for chunk in self._chunks:
                completion = chunk.completion or completion
                self._deliver(chunk)
            self._deliver(_END)
        except _LoopClosed:  # the server shut down: stop generating
            self._chunks.close()
        except Exception as error:
            logger.exception("generation failed")
            with contextlib.suppress(_LoopClosed):
                self._deliver(error)
        finally:
            with contextlib.suppress(_LoopClosed):
                self._call(self._settle, completion)

    def _deliver(self, item: Any) -> None:
        self._call(self._queue.put_nowait, item)

    def _call(self, function: Any, *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(function, *args)
        except RuntimeError as error:  # asyncio's "Event loop is closed"
            raise _LoopClosed from error

    def _settle(self, completion: Completion | None) -> None:
        if not self.finished.done():
            self.finished.set_result(completion)

    async def __aiter__(self) -> AsyncIterator[GenerationChunk]:
        finished = False
        try:
            while True:
                item = await self._queue.get()
                if item is _END:
                    finished = True
                    return
                if isinstance(item, Exception):
                    finished = True
                    raise item
                yield item
        finally:
            if not finished:  # the consumer left (a client that went away): stop the work
                self.cancel()


class GenerationWorker:
    """Runs a Runner's generations one at a time, first come first served.

    Args:
        runner: the loaded model and its cache; nothing else should generate with it.
    """

    def __init__(self, runner: Runner):
        self.runner = runner
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlxkv-generate")

    async def start(self, prompt: Any, **options: Any) -> GenerationStream:
        """Validates and queues a generation (`Runner.stream` arguments).

        Raises:
            ValueError, ContextLengthError: bad input, before anything is queued.
        """
        cancel = threading.Event()
        # Encoding and fitting may take a while for a long prompt: off the event loop.
        chunks = await run_in_threadpool(self.runner.stream, prompt, cancel=cancel, **options)
        stream = GenerationStream(chunks, cancel)
        self._executor.submit(stream.pump)
        return stream

    def shutdown(self) -> None:
        """Cancels what is running or waiting and waits for the worker thread to end."""
        self.runner.cancel()
        self._executor.shutdown(wait=True, cancel_futures=False)
