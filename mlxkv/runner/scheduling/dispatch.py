"""Dispatching a Runner's requests: each one runs on the engine thread for the thread that
streams it, alone in turn, or interleaved with the other batched streams in one of `max_batch`
slots.

Owns `Dispatcher`: the threads reading a stream (a second stream on one of them is refused),
the requests started and not ended (what `cancel` reaches), the slots in the decode batch,
and the memory line. Does not own what a request does on the model,
its entry's claim and release included (`mlxkv.runner.request_run`), how work reaches the engine
thread (`engine`), or building the request (`mlxkv.runner.request_builder`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import TypeVar

import mlx.core as mx

from mlxkv.cache.layers.kv import Rotation
from mlxkv.config import RunnerConfig
from mlxkv.decoding.batch import DecodeBatch
from mlxkv.decoding.drafts import DraftModel
from mlxkv.decoding.pause import PAUSE, Pause
from mlxkv.decoding.prefill.chunks import PrefillPlan
from mlxkv.errors import RunnerBusyError
from mlxkv.models.loading import LoadedModel
from mlxkv.platform.random_state import request_random_state, with_own_key
from mlxkv.runner.assembly import probe_padded_state
from mlxkv.runner.prefill.group import PrefillGroup
from mlxkv.runner.prompt_cache.pool import CachePool
from mlxkv.runner.prompt_cache.report import MemoryLine
from mlxkv.runner.request import Request
from mlxkv.runner.request_run import Batching, run_request
from mlxkv.runner.results import Completion, CompletionStats, GenerationChunk
from mlxkv.runner.run_context import RunContext
from mlxkv.runner.scheduling.engine import EngineThread, Interleaved, Relay
from mlxkv.runner.scheduling.lockstep import Lockstep, Solo
from mlxkv.runner.scheduling.slots import Slots

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Dispatcher:
    """Runs a Runner's requests on its engine thread for the threads streaming them.

    Args:
        loaded: the model and tokenizer.
        pool: the prompt cache's entries.
        engine: the thread every model call runs on.
        config: the Runner's settings (its context window included).
        draft: the draft model for speculative decoding, or None.
        rotations: per layer, how to re-rotate keys when the context shifts (None: cannot).
        prefill_plan: how prompt tokens are fed.
        lockstep: the sharded ranks' coordination (`Solo` when not sharded).
        max_batch: the most batched streams decoding together.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        pool: CachePool,
        engine: EngineThread,
        config: RunnerConfig,
        *,
        draft: DraftModel | None,
        rotations: list[Rotation | None],
        prefill_plan: PrefillPlan,
        lockstep: Lockstep | Solo,
        max_batch: int,
    ):
        self.loaded = loaded
        self.config = config
        self.max_context = config.max_context
        self.prefill_plan = prefill_plan
        self._pool = pool
        self._engine = engine
        self._lockstep = lockstep
        # The memory line logged as each request ends (sharded: with the ranks' sum).
        self._memory = MemoryLine(pool, lockstep.ranks_line)
        self._context = RunContext(
            loaded=loaded,
            pool=pool,
            config=config,
            draft=draft,
            rotations=rotations,
            plan=prefill_plan,
            ended=self._memory.log,
        )
        self._consumers: dict[int, Relay | Interleaved] = {}  # threads iterating a stream()
        self._slots = Slots(max_batch)
        batch = DecodeBatch(loaded.model, max_batch, others_waiting=lambda: engine.jobs_waiting)
        # sharded ranks never batch: the probe's model calls would run on this rank alone
        probe_rows = 1 if lockstep.sharded else max_batch
        prefills = PrefillGroup(
            loaded.model,
            max_prompt_tokens=prefill_plan.step_tokens,
            max_rows=max_batch,
            queued=lambda: engine.arrivals_waiting,
            padded_state_exact=engine.call(probe_padded_state, loaded, config, probe_rows),
        )
        self._batching = Batching(batch, prefills)
        pool.working = batch
        self._requests: weakref.WeakSet[threading.Event] = weakref.WeakSet()
        self._requests_lock = threading.Lock()

    def stream(self, request: Request, *, batched: bool) -> Iterator[GenerationChunk]:
        """The chunks of `request` (see `Runner.stream`), batched with the other batched
        streams (not when sharded) or alone in turn."""
        with self._requests_lock:
            self._requests.add(request.cancelled)
        if batched and not self._lockstep.sharded:
            return self._consume_interleaved(request)
        return self._consume(request)

    def cancel(self) -> None:
        """Sets the cancel flag of every request started and not ended."""
        with self._requests_lock:
            started = list(self._requests)
        for cancelled in started:
            cancelled.set()

    @property
    def inside_stream(self) -> bool:
        """True on a thread still reading a stream of this Runner."""
        return threading.get_ident() in self._consumers

    def call(self, fn: Callable[[], T]) -> T:
        """Runs `fn()` on the engine thread: after the running generation, or inside this
        thread's own stream (whose generation waits for this thread meanwhile) between two
        of its chunks."""
        relay = self._consumers.get(threading.get_ident())
        if relay is not None:
            return relay.call(fn)
        return self._engine.call(fn)

    def follow(self, reset: Callable[[], None], drop: Callable[[str], int]) -> Iterator[Completion]:
        """Runs the leading rank's requests, resets (`reset`) and dropped entries (`drop`) in
        step with it (see `Runner.follow`)."""
        return self._relay(lambda: self._lockstep.follow(self._serve, reset, drop))

    def _consume(self, request: Request) -> Iterator[GenerationChunk]:
        """The caller's side of a request: its chunks, computed on the engine thread."""
        try:
            yield from self._relay(lambda: self._serve(request))
        finally:
            with self._requests_lock:
                self._requests.discard(request.cancelled)

    def _consume_interleaved(self, request: Request) -> Iterator[GenerationChunk]:
        """A batched stream's side: waits for one of `max_batch` places, then its chunks."""
        try:
            self._refuse_second_stream()
            if not self._slots.acquire(request.cancelled):
                stats = CompletionStats(
                    time.perf_counter(), prompt_tokens=len(request.tokens), cached=0
                )
                yield stats.final_chunk("", "cancelled")
                return
            try:
                yield from self._relay(lambda: self._serve_interleaved(request), interleaved=True)
            finally:
                self._slots.release()
        finally:
            with self._requests_lock:
                self._requests.discard(request.cancelled)

    def _refuse_second_stream(self) -> None:
        """Raises RunnerBusyError on a thread still reading a stream of this Runner: its new
        one would wait on the first (for the engine, or for a place), which only this thread
        can finish."""
        if threading.get_ident() in self._consumers:
            raise RunnerBusyError(
                "this thread is still iterating another stream() of this Runner; "
                "finish it or close() it before starting a new generation (waiting "
                "would never end)"
            )

    def _relay(self, make: Callable[[], Iterator[T]], *, interleaved: bool = False) -> Iterator[T]:
        """The items of the generator `make()` returns, run on the engine thread for this
        thread. A second one on a thread still reading one would wait on the first, which
        only this thread can finish: refused before it is queued. Meanwhile this thread's
        `cache_tokens` reads go through the relay (the engine is busy with its generator)."""
        me = threading.get_ident()
        with self._requests_lock:
            self._refuse_second_stream()
            engine = self._engine
            relay = engine.interleave(make) if interleaved else engine.iterate(make)
            self._consumers[me] = relay
        try:
            yield from relay
        finally:
            with self._requests_lock:
                del self._consumers[me]

    def _serve(self, request: Request) -> Iterator[GenerationChunk]:
        """One request on the engine thread, start to end, alone."""
        mx.reset_peak_memory()
        with request_random_state(request.params.seed):
            chunks = self._lockstep.run(
                request, functools.partial(run_request, context=self._context)
            )
            with contextlib.closing(chunks):
                for chunk in chunks:
                    if chunk is not PAUSE:  # nobody to let run here
                        yield chunk

    def _serve_interleaved(self, request: Request) -> Iterator[GenerationChunk | Pause]:
        """One request on the engine thread, taking turns with the other interleaved ones
        (each item is one engine job; `PAUSE` lets the others run)."""
        chunks = run_request(request, self._context, batching=self._batching)
        if request.params.seed is not None:
            chunks = with_own_key(chunks, request.params.seed)
        with contextlib.closing(chunks):
            yield from chunks

    @property
    def memory_line(self) -> str:
        """The memory line logged after the last generation."""
        return self._memory.text
