"""Which served models are in memory: loaded on their first request, unloaded after their
keep-alive or when another model needs the memory.

Owns `Residency` (every served model under one memory budget: when each loads and unloads).
A model's footprint is its weights plus its prompt cache's byte budget
(`Runner.cache_info().budget_bytes`), measured by its `ResidentModel` (`model.py`).

Invariants:
  - a model with requests in flight is never unloaded;
  - a model loads once however many requests wait for it (the others wait for that load), in
    a task of its own: a load whose requests all left (their tasks cancelled) goes on in its
    reserved room, and its model stays loaded, idle, until its keep-alive ends;
  - a model that requests wait to take (`_waiting`) is never unloaded, as one in use;
  - loads of different models run side by side (a tiny model waited 6.7 s behind a larger
    one's load); under a budget, each first makes room for its estimate and holds it
    (`_reserved_bytes`) until it is loaded, so loads side by side never overshoot it; a load
    waiting for room is passed by at most `MOST_LOADS_FIRST` later ones that fit while it waits
    (as they come, or once memory frees);
  - unloading writes the model's cache to its disk tier (`Runner.close`) before a request can
    load it again, so a model loaded again starts warm;
  - a model given loaded (a Runner, not a `ModelLoader`) is never unloaded: nothing could load
    it again;
  - after a stop signal (`begin_shutdown`) no request gets a worker: a load that ends after it
    serves nothing (its requests get the 503 a stopping server answers).
Every decision runs on the event loop (the slow parts, loading and closing, on a thread), so
the bookkeeping needs no thread lock. Does not own which name a request means (`served.py`),
nor one model's state and what its load measures (`model.py`).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import time
from collections.abc import Callable

import mlx.core as mx
from starlette.concurrency import run_in_threadpool

from mlxkv.config import format_bytes
from mlxkv.platform.machine import return_freed_memory
from mlxkv.runner.runner import Runner
from mlxkv.server.errors import ApiError
from mlxkv.server.middleware import SHUTTING_DOWN
from mlxkv.server.models.model import ResidentModel
from mlxkv.server.worker import GenerationWorker

logger = logging.getLogger(__name__)

# Seconds a stopping server may spend starting to write its models' entries to their disk
# tiers, shared by the models loaded (a second Ctrl-C or SIGTERM stops at once; docker waits
# 10 s before SIGKILL, systemd 90 s).
SHUTDOWN_SAVE_S = 8.0

# Loads asked after one that waits for room (for busy models' requests to end) that go first,
# beside the loaded models, when they fit now. Each may hold room the waiting one needs for as
# long as its requests run (idle, it is unloaded for it), so that wait grows by at most this many.
MOST_LOADS_FIRST = 2


class Residency:
    """Every served model, loaded on demand under one memory budget.

    Args:
        models: the served models.
        make_worker: a worker for a Runner just loaded.
        budget_bytes: most bytes the loaded models' footprints may add up to; None: no limit.
        keep_alive_s: seconds an idle model stays loaded when a request names none (negative:
            for good; 0: unloaded as its last request ends).
    """

    def __init__(
        self,
        models: list[ResidentModel],
        make_worker: Callable[[Runner], GenerationWorker],
        budget_bytes: int | None,
        keep_alive_s: float,
    ):
        self.models = models
        self.budget_bytes = budget_bytes
        self.keep_alive_s = keep_alive_s
        self._make_worker = make_worker
        # one load at a time decides what to unload and reserves its room (not held while
        # it loads: the others', which fit beside it, go on meanwhile)
        self._room = asyncio.Lock()
        self._reserved_bytes = 0  # the estimates of the models loading now
        self._waiting_for_room: str | None = None  # the load that holds `_room`, waiting
        self._loads_first = 0  # loads that went before it
        self._loads_under_way = 0
        self._released = asyncio.Event()  # a request ended: memory may be free to take
        self._tasks: set[asyncio.Task] = set()
        self._stopping = False  # a stop signal came: no request starts now
        for model in models:
            if model._given is not None:
                model._attach(model._given, make_worker(model._given))

    @property
    def used_bytes(self) -> int:
        return sum(m.footprint_bytes for m in self.models if m.worker is not None)

    async def acquire(self, model: ResidentModel) -> GenerationWorker:
        """The model's worker, loading it first if it is not loaded; the model stays loaded
        until the matching `release`.

        Raises:
            ApiError: 500 when it fails to load, 507 when it cannot fit in the budget, 503
                once the server is stopping (its load may have ended after the stop signal).
        """
        model._waiting += 1  # from here it is not unloaded, as if in use
        try:
            if model.worker is None and not self._stopping:
                await asyncio.shield(self._loading(model))  # left: the load goes on
            async with model._lock:
                if self._stopping:
                    raise ApiError(503, SHUTTING_DOWN)
                model.in_flight += 1
                model.last_used_s = time.monotonic()
                model.expires_at = None
                if model._timer is not None:
                    model._timer.cancel()
                assert model.worker is not None
                return model.worker
        finally:
            model._waiting -= 1

    def _loading(self, model: ResidentModel) -> asyncio.Task:
        """The model's load under way, started if none is: a task of its own, so the requests
        waiting for it may leave (cancelled) without ending it. One that ended counts as none:
        its done callback (`_load_ended`) runs a turn later, after a request queued before it."""
        if model._load_task is None or model._load_task.done():
            model._load_task = task = self._spawn(self._load_once(model))
            task.add_done_callback(functools.partial(_load_ended, model))
        return model._load_task

    async def _load_once(self, model: ResidentModel) -> None:
        async with model._lock:
            if model.worker is not None or self._stopping:  # loaded, or never to serve
                return
            await self._load(model)
            if not model._waiting:  # its requests all left while it loaded: kept, idle
                logger.info("model=%s loaded after its requests left: kept idle", model.name)
                self._expire_after(model, self.keep_alive_s)

    def release(self, model: ResidentModel, keep_alive_s: float | None) -> None:
        """A request's end: the model expires `keep_alive_s` (None: the server's default)
        after its last request ends."""
        model.in_flight -= 1
        model.last_used_s = time.monotonic()
        self._released.set()
        if not model.in_flight:
            self._expire_after(model, self.keep_alive_s if keep_alive_s is None else keep_alive_s)

    def unload_when_idle(self, model: ResidentModel) -> None:
        """Ollama's unload request (`keep_alive` 0, nothing to generate): a loaded idle model
        unloads now; a busy one (requests in flight or waiting, a load under way: the
        requests that started it may have left) as its last request or its load ends; one
        not loaded is not loaded for it."""
        loading = model._load_task is not None and not model._load_task.done()
        busy = model.in_flight or model._waiting or loading
        if model.worker is not None and not busy:
            self._expire_after(model, 0.0)
        elif busy:  # its last request's end (or its load's) unloads it, whatever it asked
            model._unload_at_end = True

    def _expire_after(self, model: ResidentModel, keep_s: float) -> None:
        if model._unload_at_end:
            keep_s, model._unload_at_end = 0.0, False
        if keep_s < 0 or model.pinned:
            return
        model._expiry += 1
        model.expires_at = time.time() + keep_s
        expiry = model._expiry
        if keep_s == 0:  # now, not at the loop's next turn
            self._spawn(self._expire(model, expiry))
            return
        model._timer = asyncio.get_running_loop().call_later(
            keep_s, lambda: self._spawn(self._expire(model, expiry))
        )

    async def _expire(self, model: ResidentModel, expiry: int) -> None:
        async with model._lock:
            if model._expiry == expiry and _unloadable(model):
                await self._unload(model)

    async def _load(self, model: ResidentModel) -> None:
        assert model.loader is not None
        if await self._goes_first(model):
            self._loads_first += 1
            self._reserved_bytes += model.footprint_bytes
            logger.info(
                "model=%s loads before model=%s, which waits for room",
                model.name,
                self._waiting_for_room,
            )
            loaded = None
        else:
            loaded = await self._take_room(model)
        runner, load_s = loaded or await self._run_loader(model)
        model._attach(runner, self._make_worker(runner))
        model.num_loads += 1
        logger.info(
            "loaded model=%s in %.1fs: %s (weights and cache budget), %s of %s in use",
            model.name,
            load_s,
            format_bytes(model.footprint_bytes),
            format_bytes(self.used_bytes),
            "no limit" if self.budget_bytes is None else format_bytes(self.budget_bytes),
        )
        try:  # measured now: more than its estimate may leave too little room
            self._check_fits(model)
        except ApiError:
            await self._unload(model)
            raise
        await self._make_room(model.name, 0, wait=False)

    async def _goes_first(self, model: ResidentModel) -> bool:
        """Whether `model`'s load goes ahead of the one waiting for room (`_may_go_first`),
        asked again each time memory may have freed while that one waits (a request or a
        load ended: one that went first failed), not only as it comes; False once none waits
        (its turn then comes in order, `_take_room`)."""
        while self._waiting_for_room is not None:
            if self._may_go_first(model):
                return True
            self._released.clear()
            await self._released.wait()
        return False

    def _may_go_first(self, model: ResidentModel) -> bool:
        """Whether `model`'s load goes ahead of the one waiting for room: its size is known,
        it fits beside the loaded models and the loads under way now, and fewer than
        `MOST_LOADS_FIRST` went first (only under a budget: without one, no load waits for
        room)."""
        return (
            self._waiting_for_room is not None
            and model.footprint_bytes > 0
            and self._loads_first < MOST_LOADS_FIRST
            and self.used_bytes + self._reserved_bytes + model.footprint_bytes <= self.budget_bytes
        )

    async def _take_room(self, model: ResidentModel) -> tuple[Runner, float] | None:
        """Waits for `model`'s turn (first come first served, but for loads that go first)
        and for room for its estimate, then reserves it (returns None); a model of unknown
        size under a budget loads here instead (returns its Runner and seconds): after the
        loads under way, and with none beside it (it holds the room) till measured."""
        async with self._room:
            self._loads_first = 0
            self._check_fits(model)
            await self._make_room(model.name, model.footprint_bytes, wait=True)
            if self.budget_bytes is None or model.footprint_bytes:
                self._reserved_bytes += model.footprint_bytes
                return None
            while self._loads_under_way:
                self._released.clear()
                await self._released.wait()
            return await self._run_loader(model)

    async def _run_loader(self, model: ResidentModel) -> tuple[Runner, float]:
        """`model`'s loader run on a thread, and its seconds; its reserved room (the estimate
        `_load` added to `_reserved_bytes`) counted as loaded from the end (no await before
        `_attach`).

        Raises:
            ApiError: 500 when it fails to load.
        """
        assert model.loader is not None
        logger.info("loading model=%s (%s in use)", model.name, format_bytes(self.used_bytes))
        self._loads_under_way += 1
        started = time.perf_counter()
        try:
            return await run_in_threadpool(model.loader.load), time.perf_counter() - started
        except Exception as error:
            logger.error("model=%s failed to load: %s", model.name, error)
            raise ApiError(500, f"model '{model.name}' failed to load: {error}") from error
        finally:
            self._loads_under_way -= 1
            self._reserved_bytes -= model.footprint_bytes  # the estimate: not attached yet
            self._released.set()  # a failed load's room is free; a loaded one's measured

    def _check_fits(self, model: ResidentModel) -> None:
        """Raises a 507 for a model that cannot fit even with every other unloaded."""
        if self.budget_bytes is None:
            return
        pinned = sum(m.footprint_bytes for m in self.models if m.pinned)
        if pinned + model.footprint_bytes <= self.budget_bytes:
            return
        held = f", {format_bytes(pinned)} of it held by models loaded at start" if pinned else ""
        raise ApiError(
            507,
            f"model '{model.name}' needs {format_bytes(model.footprint_bytes)} (weights and "
            f"cache budget); the memory budget is {format_bytes(self.budget_bytes)}{held}; "
            "raise --max-memory or lower --cache-bytes",
        )

    async def _make_room(self, name: str, extra_bytes: int, wait: bool) -> None:
        """Unloads idle models, least recently used first, until `extra_bytes` more fit;
        with `wait`, waits for busy ones to finish their requests when that is not enough
        (else says the budget is exceeded)."""
        while (
            self.budget_bytes is not None
            and self.used_bytes + self._reserved_bytes + extra_bytes > self.budget_bytes
        ):
            idle = [m for m in self.models if _unloadable(m) and not m._lock.locked()]
            if not idle and not wait:
                logger.warning(
                    "model=%s: %s in use is over the memory budget of %s (the others are busy)",
                    name,
                    format_bytes(self.used_bytes),
                    format_bytes(self.budget_bytes),
                )
                return
            if not idle:  # every other one is busy: wait for a request to end
                self._released.clear()
                self._waiting_for_room = name  # later loads that fit may go first meanwhile
                try:
                    await self._released.wait()
                finally:
                    self._waiting_for_room = None
                    self._released.set()  # loads waiting to go first take their turn now
                continue
            victim = min(idle, key=lambda m: m.last_used_s)
            async with victim._lock:  # a request waiting for it may have taken it first
                if _unloadable(victim):
                    logger.info("model=%s unloads model=%s to make room", name, victim.name)
                    await self._unload(victim)

    async def _unload(self, model: ResidentModel) -> None:
        """Closes the model's worker and Runner (its entries written to its disk tier) and
        lets its memory go; `model._lock` is held."""
        worker, model.worker, model.expires_at = model.worker, None, None
        assert worker is not None
        logger.info("unloading model=%s (%s)", model.name, format_bytes(model.footprint_bytes))
        await run_in_threadpool(_close, worker, True)
        del worker
        gc.collect()  # the weights' arrays go with the Runner's last reference
        mx.clear_cache()
        await run_in_threadpool(return_freed_memory)  # tens of ms for a GiB: off the loop

    def _spawn(self, coroutine) -> asyncio.Task:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def begin_shutdown(self) -> None:
        """Ends every loaded model's generations, running or waiting (from any thread: a
        signal handler); each stream ends with its API's error event. A request whose model is
        still loading is refused when its load ends (`acquire`)."""
        self._stopping = True
        for model in self.models:
            worker = model.worker
            if worker is not None:
                worker.begin_shutdown()

    def shutdown(self, save_timeout_s: float | None = None) -> None:
        """At the server's end: stops every worker and closes the Runners this server loaded
        (writing their entries to their disk tiers); those given loaded are their owner's.
        One that fails to close is logged, and the others still close."""
        for task in self._tasks:
            task.cancel()
        loaded = [m for m in self.models if m.worker is not None]
        for model in loaded:
            assert model.worker is not None
            share_s = None if save_timeout_s is None else save_timeout_s / len(loaded)
            _close(model.worker, not model.pinned, share_s)


def _unloadable(model: ResidentModel) -> bool:
    busy = model.in_flight or model._waiting
    return model.worker is not None and not model.pinned and not busy


def _load_ended(model: ResidentModel, task: asyncio.Task) -> None:
    """A load's end: the next request starts another if this one failed. Its error was
    raised to the requests that waited, and logged (`_run_loader`) for none."""
    if model._load_task is task:  # not the one a request started since (`_loading`)
        model._load_task = None
    if model.worker is None:  # it failed: an unload asked meanwhile is not for a later load
        model._unload_at_end = False
    if not task.cancelled():
        task.exception()  # retrieved: asyncio logs none that no request awaited


def _close(worker: GenerationWorker, close_runner: bool, save_timeout_s: float | None = None):
    """Stops the worker and closes its Runner (its entries go to its disk tier); a failure is
    logged, not raised: the caller goes on with the other models."""
    try:
        worker.shutdown()
        if close_runner:
            worker.runner.close(save_timeout_s=save_timeout_s)
    except Exception:
        logger.exception("closing a model failed")
