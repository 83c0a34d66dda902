"""The one thread that runs a Runner's MLX work.

Why: MLX gives each thread its own streams (and random key); an array built on one thread's
stream cannot be evaluated on another, and a thread's streams are torn down when it ends.
Requests run on their callers' threads (the Python API's, the server's) left arrays crossing
threads and a finishing thread tearing down its streams while another thread generated on
arrays it had produced: on MLX's CUDA backend two threads generating at once aborted the
process. Here every model call, cache copy, disk load and write of a Runner runs on one
long-lived thread; callers hand it work and read results back.

Owns `EngineThread`: `call(fn)` (run fn there, return its result), `iterate(make)` (run a
generator there, relaying its items to the caller one at a time, as if the caller iterated
it; the thread does nothing else until it ends), `interleave(make)` (the same, one job per
item, so that several generators take turns: a decode batch's requests), and the thread's
lifetime: started on first use, ended when its owner is collected or the interpreter exits.
It runs on a kept thread (`mlxkv.platform.threads.run_on_kept_thread`: MLX keeps a
thread's native stream threads after it ends), which runs the next engine started after this
one ends. Does not own what the work is (`runner`).
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import contextlib
import copy
import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import mlx.core as mx

from mlxkv.decoding.pause import PAUSE, Pause
from mlxkv.platform.threads import KeptRun, run_on_kept_thread

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineThread:
    """A worker thread that runs jobs one at a time, in the order they come (except the first
    item of an interleaved generator, which goes ahead of the jobs waiting).

    Args:
        name: the thread's name (shown in stack dumps).
    """

    def __init__(self, name: str):
        self._name = name
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._urgent: collections.deque[Callable[[], None]] = collections.deque()
        # The kept thread's run of this engine, while it runs: one attribute, so that `stop`
        # reads it whole without `_start_lock`.
        self._run: KeptRun | None = None
        self._stop_asked = False  # the run ends once no job is queued (see `stop`)
        self._start_lock = threading.Lock()  # guards starting a run, and `_wakeups`
        self._wakeups = 0  # `_run_ahead` wake-ups in `_jobs`
        self._relays: weakref.WeakSet[Relay] = weakref.WeakSet()  # `iterate`'s, for `_stop_all`
        # What `abandon` fails: the streams being read and the calls not answered yet.
        self._interleaved: weakref.WeakSet[Interleaved] = weakref.WeakSet()
        self._calls: set[concurrent.futures.Future[Any]] = set()
        self._abandoned: BaseException | None = None  # what every later job raises

    @property
    def is_current(self) -> bool:
        """True on the engine thread itself."""
        run = self._run
        return run is not None and threading.current_thread() is run.thread

    @property
    def jobs_waiting(self) -> bool:
        """True while jobs wait to run (besides the one running; a wake-up left in the queue
        by a job that ran ahead is not one). A reading: other threads may add jobs."""
        return bool(self._urgent) or self._jobs.qsize() > self._wakeups

    @property
    def arrivals_waiting(self) -> bool:
        """True while the first items of interleaved generators (requests just started) wait
        to run: they run before any other job."""
        return bool(self._urgent)

    def call(self, fn: Callable[..., T], *args: Any, timeout_s: float | None = None) -> T:
        """Runs `fn(*args)` on the engine thread after the jobs before it (an interleaved
        generator's first item may still go ahead of it); returns its result
        or raises its exception. On the engine thread itself, runs it at once.

        Raises:
            TimeoutError: the result did not come within `timeout_s` (None: wait for it);
                the job still runs, or waits its turn.
            BaseException: `abandon`'s error, once the thread is abandoned.
        """
        if self.is_current:
            return fn(*args)
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def job() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    outcome = fn(*args)
                except BaseException as error:  # handed to the caller, who raises it
                    _settle(future.set_exception, error)
                else:
                    _settle(future.set_result, outcome)

        with self._start_lock:
            self._calls.add(future)
        try:
            self._submit(job)
            return future.result(timeout_s)
        except concurrent.futures.CancelledError:  # by `abandon`, before it ran
            raise self._abandoned_error() from None
        finally:
            with self._start_lock:
                self._calls.discard(future)

    def iterate(self, make: Callable[[], Iterator[T]]) -> Relay:
        """The items of the generator `make()` returns, each computed on the engine thread
        when the caller asks for it, exactly as if the caller iterated the generator itself:
        nothing runs ahead, a caller that stops early closes it (its `finally` runs on the
        engine thread before the caller goes on), and its exceptions reach the caller."""
        relay = Relay()
        self._relays.add(relay)
        self._submit(lambda: relay.pump(make))
        return relay

    def interleave(self, make: Callable[[], Iterator[T | Pause]]) -> Interleaved:
        """The items of the generator `make()` returns, like `iterate`, except that each item
        is computed by a job of its own: the jobs of other interleaved generators and calls
        run between two items. The generator yields `PAUSE` to pause: its next part runs after
        the jobs waiting then (a long prefill lets running requests decode between its
        chunks); the caller never sees a pause. The first item's job goes ahead of those
        waiting (at most one per interleaved generator: a decode step each), so a new
        request's prefill starts at the next turn, not after a round of them."""
        interleaved = Interleaved(self, make)
        self._interleaved.add(interleaved)
        return interleaved

    def stop(self, wait: bool = True) -> None:
        """Ends the thread after the jobs already given (it starts again on the next job).

        Takes no lock: a Runner's finalizer calls it, and a garbage collection can run that
        on a thread holding `_start_lock` in `_submit`, about to start a run. That run ends
        after its job (`_stop_asked`); a None put as a run ends is taken by the next, which
        goes on while jobs are queued."""
        self._stop_asked = True
        run = self._run
        if run is None:
            return
        self._jobs.put(None)  # SimpleQueue.put: reentrant, safe inside a collection
        if wait and run.thread is not threading.current_thread():
            run.ended.wait()

    def abandon(self, error: BaseException) -> None:
        """Gives up on the thread, stuck in a job that will never end (a collective whose
        peer froze or is gone): it is not waited for at exit, and every caller waiting on it
        (a stream's reader, a `call`, the stuck job's own included) and every later one
        raises a copy of `error` instead of waiting without end. The thread stays stuck."""
        with self._start_lock:
            self._abandoned = error
            _running.discard(self)
            calls = list(self._calls)
        for reader in [*self._relays, *self._interleaved]:
            reader.fail(copy.copy(error))
        for future in calls:
            if not future.cancel():  # running (or just done): answered here instead
                _settle(future.set_exception, copy.copy(error))

    def _abandoned_error(self) -> BaseException:
        assert self._abandoned is not None  # futures are cancelled by `abandon` alone
        return copy.copy(self._abandoned)

    def _submit(self, job: Callable[[], None], *, ahead: bool = False) -> None:
        """Queues `job` after the others, or with `ahead` before those not started yet.

        Raises:
            BaseException: `abandon`'s error, once the thread is abandoned.
        """
        with self._start_lock:
            if self._abandoned is not None:
                raise self._abandoned_error()
            if self._run is None or not self._run.thread.is_alive():
                self._run = run_on_kept_thread(self._loop, self._name)
                _running.add(self)
            if ahead:
                self._urgent.append(job)
                job = _run_ahead  # wakes the thread; the job itself runs before the next taken
                self._wakeups += 1
            # under the lock: a loop taking a stop sees this job queued, or it started a run
            self._jobs.put(job)

    def _loop(self) -> None:
        """The jobs, until a stop and no job queued."""
        # A new thread's random key is the same in every thread of the process (MLX derives
        # it from the process's start time), and a kept one's is the last engine's: draw this
        # engine's from the OS instead.
        mx.random.seed(int.from_bytes(os.urandom(8), "little"))
        try:
            while True:
                job = self._jobs.get()
                if job is not None:
                    if job is _run_ahead:
                        with self._start_lock:
                            self._wakeups -= 1
                    while self._urgent:
                        self._urgent.popleft()()
                    job()  # jobs hand their own errors to their callers
                    del job  # held while waiting for the next, it would keep its arrays alive
                    if not self._stop_asked:
                        continue
                mx.synchronize()
                with self._start_lock:  # a job given after the stop runs on here
                    if self._jobs.empty():
                        self._run, self._stop_asked = None, False
                        _running.discard(self)
                        return
        finally:
            with self._start_lock:
                if self.is_current:  # ended by an error: the next job starts a run on
                    self._run = None  # another thread
                    _running.discard(self)


class Relay:
    """A generator running on the engine thread, iterated by one consumer thread; between
    two items (the generator paused) that consumer may `call` functions there too."""

    def __init__(self):
        # ("next", None), ("call", fn) or ("close", None), from the consumer
        self._asks: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        # ("item" | "result" | "error" | "end", value), from the engine
        self._answers: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()

    def pump(self, make: Callable[[], Iterator[Any]]) -> None:
        """Engine side: advances the generator at each ask, until it ends or is closed."""
        try:
            generator = make()
        except BaseException as error:  # raised to the consumer at its first ask
            self._answers.put(("error", error))
            return
        try:
            while (ask := self._asks.get())[0] != "close":
                if ask[0] == "call":
                    self._answers.put(_outcome(ask[1]))
                    continue
                try:
                    item = next(generator)
                except StopIteration:
                    self._answers.put(("end", None))
                    return
                except BaseException as error:
                    self._answers.put(("error", error))
                    return
                self._answers.put(("item", item))
            generator.close()  # the consumer left: its `finally` runs here, now
            self._answers.put(("end", None))
        except BaseException as error:  # closing raised: the consumer still waits for the end
            self._answers.put(("error", error))

    def call(self, fn: Callable[[], T]) -> T:
        """Consumer side, between two items: runs `fn()` on the engine thread."""
        self._asks.put(("call", fn))
        kind, value = self._answers.get()
        if kind == "error":
            raise value
        return value

    def __iter__(self) -> Iterator[Any]:
        """Consumer side: the items."""
        return _consumed(lambda: self._asks.put(("next", None)), self._answers, self._close)

    def _close(self) -> None:
        self._asks.put(("close", None))
        kind, item = self._answers.get()
        if kind == "error":
            raise item

    def end(self) -> None:
        """Ends the generator as if its consumer closed it, waiting for nothing (at exit, a
        stream a script left open: its job waits for an ask that never comes)."""
        self._asks.put(("close", None))

    def fail(self, error: BaseException) -> None:
        """Consumer side, from any thread: its next item (or the one it waits for) raises
        `error` (the engine is stuck and will never answer)."""
        self._answers.put(("error", error))


class Interleaved:
    """A generator advanced one item per engine job (see `EngineThread.interleave`), iterated
    by one consumer thread."""

    def __init__(self, engine: EngineThread, make: Callable[[], Iterator[Any]]):
        self._engine = engine
        self._make = make
        self._generator: Iterator[Any] | None = None
        self._answers: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()

    def _advance(self) -> None:
        """Engine side: one item (pauses are put back in the queue, unanswered)."""
        try:
            if self._generator is None:
                self._generator = self._make()
            item = next(self._generator)
        except StopIteration:
            self._answers.put(("end", None))
        except BaseException as error:  # raised to the consumer
            self._answers.put(("error", error))
        else:
            if item is PAUSE:
                self._engine._submit(self._advance)
            else:
                self._answers.put(("item", item))

    def _close(self) -> None:
        if self._generator is not None:
            self._generator.close()

    def call(self, fn: Callable[[], T]) -> T:
        """Consumer side, between two items: runs `fn()` on the engine thread."""
        return self._engine.call(fn)

    def fail(self, error: BaseException) -> None:
        """As `Relay.fail`."""
        self._answers.put(("error", error))

    def __iter__(self) -> Iterator[Any]:
        """Consumer side: the items."""
        return _consumed(
            lambda: self._engine._submit(self._advance, ahead=self._generator is None),
            self._answers,
            lambda: self._engine.call(self._close),
        )


def _consumed(
    ask: Callable[[], None],
    answers: queue.SimpleQueue[tuple[str, Any]],
    close: Callable[[], None],
) -> Iterator[Any]:
    """The consumer's side of a generator run on the engine thread: `ask()` for each item,
    read from `answers`, its errors raised here; a consumer that leaves early calls `close()`,
    which closes the generator there and waits until it has."""
    ended = False
    try:
        while True:
            ask()
            kind, item = answers.get()
            if kind != "item":
                ended = True
                if kind == "error":
                    raise item
                return
            yield item
    finally:
        if not ended:
            try:
                close()
            except Exception as error:
                logger.warning("closing a generation raised %r", error)


def _run_ahead() -> None:
    """The place in the queue of a job run ahead: it ran already."""


def _settle(answer: Callable[[Any], None], value: Any) -> None:
    """`answer(value)` (a future's `set_result` or `set_exception`), unless `abandon` has
    answered the future already."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        answer(value)


def _outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "result", fn()
    except Exception as error:  # raised in the caller's thread
        return "error", error


_running: weakref.WeakSet[EngineThread] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """Ends every engine before the interpreter's teardown, so that its kept thread is idle
    when those end, each releasing its MLX streams itself (a thread torn down with the process
    can abort it)."""
    for engine in list(_running):
        for relay in list(engine._relays):  # streams left open end, so that the engine can
            relay.end()
        engine.stop()
