"""Models loaded on demand under one memory budget (`Residency`), driven on an event loop of the
test's own: concurrent first requests load once, keep_alive 0 unloads once the last request
ends (the weights' memory goes with it), a budget that holds two unloads the least recently used
idle model, a busy model is never unloaded (a load waits for its request to end), and a request
that races an unload waits for it and loads the model again."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import platform
import threading
import weakref

import mlx.core as mx
import pytest

from mlxkv import Runner
from mlxkv.platform.machine import return_freed_memory
from mlxkv.server.errors import ApiError
from mlxkv.server.models import resident
from mlxkv.server.models.model import ModelLoader, ResidentModel
from mlxkv.server.models.resident import Residency
from mlxkv.server.worker import GenerationWorker
from tests.factories import tiny_model_dir, wait_until

ARCHS = ("llama", "qwen3", "gemma3_text")
CACHE_BYTES = 1 << 20


class Loads:
    """Loaders of tiny factory models that count their loads and keep a weak reference to
    each Runner made (so a test sees its memory go)."""

    def __init__(self, model_root: str, tmp_path):
        self.root, self.tmp_path = model_root, tmp_path
        self.made: dict[str, list[weakref.ref]] = {}
        self.close_started = threading.Event()
        self.events: list[str] = []  # "load" and "closed", in the order they happened
        self.close_may_end: threading.Event | None = None  # set: closes wait for it

    def loader(self, arch: str, estimated_bytes: int = 0) -> ModelLoader:
        def load() -> Runner:
            self.events.append("load")
            runner = _Watched.load(
                str(tiny_model_dir(arch, self.root)),
                max_context=256,
                cache_bytes=CACHE_BYTES,
                cache_dir=self.tmp_path / "kv",
            )
            runner.loads = self
            self.made.setdefault(arch, []).append(weakref.ref(runner))
            return runner

        return ModelLoader(load, estimated_bytes)

    def failing_once(self, arch: str, why: str) -> ModelLoader:
        """`loader`, whose first load fails with an OSError saying `why`."""
        working, failures = self.loader(arch), [why]

        def load() -> Runner:
            if failures:
                raise OSError(failures.pop())
            return working.load()

        return ModelLoader(load)

    def alive(self, arch: str) -> int:
        gc.collect()
        return sum(ref() is not None for ref in self.made.get(arch, []))


class _Watched(Runner):
    loads: Loads

    def close(self, save_timeout_s=None) -> None:
        self.loads.close_started.set()
        if self.loads.close_may_end is not None:
            assert self.loads.close_may_end.wait(60)
        super().close(save_timeout_s)
        self.loads.events.append("closed")


@pytest.fixture
def loads(model_root, tmp_path):
    return Loads(model_root, tmp_path)


def _residency(sources: dict, budget_bytes=None, keep_alive_s=-1.0) -> Residency:
    models = [ResidentModel(name, source) for name, source in sources.items()]
    return Residency(models, lambda runner: GenerationWorker(runner), budget_bytes, keep_alive_s)


async def _unloads_done(residency: Residency) -> None:
    await asyncio.gather(*list(residency._tasks))


def test_concurrent_first_requests_load_once(loads):
    async def scenario():
        residency = _residency({"a": loads.loader("llama")})
        (model,) = residency.models
        workers = await asyncio.gather(*(residency.acquire(model) for _ in range(3)))
        assert model.num_loads == 1 and model.in_flight == 3
        assert len({id(w) for w in workers}) == 1
        for _ in workers:
            residency.release(model, None)
        residency.shutdown()

    asyncio.run(scenario())


def test_keep_alive_zero_unloads_when_the_last_request_ends(loads):
    async def scenario():
        residency = _residency({"a": loads.loader("llama")}, keep_alive_s=-1.0)
        (model,) = residency.models
        gc.collect()
        before_bytes = mx.get_active_memory()
        await residency.acquire(model)
        loaded_bytes = mx.get_active_memory() - before_bytes
        # measured: the weights are in memory (less a little: MLX's count is the process's,
        # and an earlier test's arrays may be freed meanwhile: 32 bytes short once in CI)
        assert loaded_bytes >= 0.9 * model.facts.weights_bytes
        await residency.acquire(model)
        residency.release(model, 0.0)  # another request still holds it
        await _unloads_done(residency)
        assert model.worker is not None
        residency.release(model, 0.0)
        await _unloads_done(residency)
        assert model.worker is None and loads.close_started.is_set()
        assert loads.alive("llama") == 0  # the weights went with the Runner
        gc.collect()
        kept_bytes = mx.get_active_memory() - before_bytes
        assert kept_bytes < loaded_bytes / 10, (kept_bytes, loaded_bytes)  # the memory came back
        await residency.acquire(model)  # loads again
        assert model.num_loads == 2 and loads.alive("llama") == 1
        residency.release(model, None)  # negative default: stays
        assert model.expires_at is None
        residency.shutdown()

    asyncio.run(scenario())


def test_a_budget_of_two_unloads_the_least_recently_used_idle_model(loads):
    async def scenario():
        probe = _residency({"a": loads.loader("llama")})
        await probe.acquire(probe.models[0])
        size = probe.models[0].footprint_bytes
        probe.release(probe.models[0], None)
        probe.shutdown()
        # every tiny model has about the same footprint: two fit, three do not
        sources = {arch: loads.loader(arch, estimated_bytes=size) for arch in ARCHS}
        residency = _residency(sources, budget_bytes=int(size * 2.5))
        a, b, c = residency.models
        for model in (a, b, a):  # b is now the least recently used
            await residency.acquire(model)
            residency.release(model, None)
        await residency.acquire(c)
        assert [m.worker is not None for m in (a, b, c)] == [True, False, True]
        assert residency.used_bytes <= residency.budget_bytes
        residency.release(c, None)
        residency.shutdown()

    asyncio.run(scenario())


def test_a_busy_model_is_never_unloaded_a_load_waits_for_it(loads):
    async def scenario():
        probe = _residency({"a": loads.loader("llama")})
        await probe.acquire(probe.models[0])
        size = probe.models[0].footprint_bytes
        probe.release(probe.models[0], None)
        probe.shutdown()
        sources = {arch: loads.loader(arch, estimated_bytes=size) for arch in ARCHS[:2]}
        residency = _residency(sources, budget_bytes=int(size * 1.5))
        a, b = residency.models
        await residency.acquire(a)  # a request in flight on a
        waiting = asyncio.ensure_future(residency.acquire(b))
        for _ in range(100):  # until b's load waits for a request to end (no thread runs)
            if residency._released._waiters:
                break
            await asyncio.sleep(0)
        assert residency._released._waiters and not waiting.done()
        assert a.worker is not None and b.num_loads == 0
        residency.release(a, None)  # a's request ends: a unloads, b loads
        await waiting
        assert a.worker is None and b.worker is not None
        residency.release(b, None)
        residency.shutdown()

    asyncio.run(scenario())


def test_a_request_racing_an_unload_waits_and_loads_again(loads):
    loads.close_may_end = threading.Event()

    async def scenario():
        residency = _residency({"a": loads.loader("llama")})
        (model,) = residency.models
        first = await residency.acquire(model)
        residency.release(model, 0.0)  # unloads: its close is held
        await asyncio.to_thread(loads.close_started.wait, 60)
        racing = asyncio.ensure_future(residency.acquire(model))

        # until it waits for the unload (or, wrongly, loads the model meanwhile)
        def waits() -> bool:
            return bool(model._lock._waiters) or len(loads.events) > 1

        await asyncio.to_thread(wait_until, waits, what="the racing request waiting")
        assert not racing.done() and loads.events == ["load"]
        loads.close_may_end.set()
        second = await racing
        assert second is not first and model.num_loads == 2 and model.in_flight == 1
        assert loads.events == ["load", "closed", "load"]  # loaded again once saved
        residency.release(model, None)
        residency.shutdown()

    asyncio.run(scenario())


def test_a_model_larger_than_the_budget_says_so_before_loading(loads):
    async def scenario():
        residency = _residency({"a": loads.loader("llama", estimated_bytes=10 << 20)}, 1 << 20)
        with pytest.raises(ApiError, match="needs 10.0 MiB.*budget is 1.0 MiB") as refused:
            await residency.acquire(residency.models[0])
        assert refused.value.status == 507 and residency.models[0].num_loads == 0

    asyncio.run(scenario())


def test_a_model_that_fails_to_load_is_a_500_naming_it(tmp_path):
    async def scenario():
        missing = ModelLoader(lambda: Runner.load(str(tmp_path / "nowhere")))
        residency = _residency({"gone": missing})
        with pytest.raises(ApiError, match="model 'gone' failed to load") as failed:
            await residency.acquire(residency.models[0])
        assert failed.value.status == 500 and residency.models[0].in_flight == 0

    asyncio.run(scenario())


def test_a_request_right_after_a_failed_load_loads_again(loads):
    """A load's end is seen by its done callbacks, which run at the loop's next turns: a
    request whose step was queued before them starts in between. It must start a fresh load,
    not get the failed one's error (the watcher below runs in that window, as such a step)."""

    async def scenario():
        residency = _residency({"a": loads.failing_once("llama", "disk gone")})
        (model,) = residency.models
        spawn, between = residency._spawn, []

        def spawn_watched(coroutine):
            task = spawn(coroutine)
            if not between:  # the failing load: ahead of its own end's callback
                task.add_done_callback(lambda _: between.append(residency._loading(model)))
            return task

        residency._spawn = spawn_watched
        with pytest.raises(ApiError, match="failed to load: disk gone"):
            await residency.acquire(model)
        (started,) = between
        await asyncio.wait_for(asyncio.shield(started), 60)  # before: the old error
        worker = await residency.acquire(model)
        assert worker is model.worker and model.num_loads == 1 and loads.events == ["load"]
        residency.release(model, None)
        residency.shutdown()

    asyncio.run(scenario())


def test_one_model_failing_to_close_does_not_keep_the_others_from_saving(loads, monkeypatch):
    async def scenario():
        residency = _residency({arch: loads.loader(arch) for arch in ARCHS[:2]})
        for model in residency.models:
            await residency.acquire(model)
            residency.release(model, None)
        first = residency.models[0].worker.runner
        monkeypatch.setattr(first, "close", _fail)
        second = residency.models[1].worker.runner
        saved = []
        monkeypatch.setattr(second, "close", lambda **kw: saved.append(kw))
        residency.shutdown(save_timeout_s=8.0)
        assert saved == [{"save_timeout_s": 4.0}]

    asyncio.run(scenario())


def _fail(**_):
    raise OSError("disk full")


def test_an_unload_asked_while_busy_happens_at_the_last_requests_end(loads):
    async def scenario():
        residency = _residency({"a": loads.loader("llama"), "b": loads.loader("qwen3")})
        a, b = residency.models
        await residency.acquire(a)
        residency.unload_when_idle(a)  # busy: not now
        residency.unload_when_idle(b)  # not loaded: not loaded for it
        await _unloads_done(residency)
        assert a.worker is not None and b.num_loads == 0
        residency.release(a, None)  # the default (-1) would keep it; the unload wins
        await _unloads_done(residency)
        assert a.worker is None and loads.close_started.is_set()

    asyncio.run(scenario())


def test_an_unload_asked_while_its_load_goes_on_happens_as_it_ends(loads):
    """The request that started the load left meanwhile (fuzz22): the unload asked then was
    dropped, and the model stayed loaded its whole keep-alive (here: for good)."""

    async def scenario():
        residency = _residency({"a": loads.loader("llama")})
        (a,) = residency.models
        request = asyncio.ensure_future(residency.acquire(a))
        await asyncio.sleep(0)  # one turn of the loop: its load has started
        load = a._load_task
        request.cancel()  # its client left; the load goes on
        residency.unload_when_idle(a)
        await load
        await _unloads_done(residency)
        assert a.num_loads == 1 and a.worker is None and loads.close_started.is_set()

    asyncio.run(scenario())


def test_an_unload_hands_the_freed_memory_back(loads, monkeypatch):
    """glibc keeps what its threads freed in their arenas: a server that unloaded its models
    kept 509 MiB resident (146 MiB handed back), fuzz22's load of three models at once."""
    handed_back = []
    monkeypatch.setattr(resident, "return_freed_memory", lambda: handed_back.append(1))

    async def scenario():
        residency = _residency({"a": loads.loader("llama")})
        (a,) = residency.models
        await residency.acquire(a)
        residency.release(a, 0.0)
        await _unloads_done(residency)
        assert a.worker is None and handed_back == [1]

    asyncio.run(scenario())


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim")
def test_freed_heap_pages_are_handed_back_where_glibc_keeps_them():
    """Blocks freed below one still in use stay in the heap (glibc trims its top alone):
    handed back only by `malloc_trim`, which says so."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(64 << 10) for _ in range(256)]  # 16 MiB, under the mmap threshold
    top = libc.malloc(64 << 10)
    try:
        for block in blocks:
            libc.free(block)
        assert return_freed_memory() is True
    finally:
        libc.free(top)


def test_an_unload_asked_during_a_load_that_failed_is_not_for_the_next_one(loads):
    """The request that started it is refused; the model's next load is a new one, kept as
    its requests ask (the unload flag stayed set: it unloaded at its first request's end)."""

    async def scenario():
        residency = _residency({"a": loads.failing_once("llama", "disk gone")})
        (a,) = residency.models
        request = asyncio.ensure_future(residency.acquire(a))
        await asyncio.sleep(0)  # one turn of the loop: its load has started
        load_task = a._load_task
        residency.unload_when_idle(a)
        with pytest.raises(ApiError, match="disk gone"):
            await request
        await asyncio.gather(load_task, return_exceptions=True)
        await asyncio.sleep(0)  # its done callbacks (`_load_ended`) run a turn later
        await residency.acquire(a)
        residency.release(a, -1.0)  # for good
        await _unloads_done(residency)
        assert a.worker is not None and a.num_loads == 1
        residency.shutdown()

    asyncio.run(scenario())


def test_an_unload_asked_while_requests_wait_for_the_model_happens_after_them(loads):
    async def scenario():
        residency = _residency({"a": loads.loader("llama")})
        (a,) = residency.models
        await residency.acquire(a)
        residency.release(a, -1.0)  # loaded, idle
        async with a._lock:  # a request waits for the model (as for room to load)
            waiting = asyncio.ensure_future(residency.acquire(a))
            await asyncio.sleep(0)
            assert a._waiting == 1 and a.in_flight == 0
            residency.unload_when_idle(a)
        await waiting
        await _unloads_done(residency)
        assert a.worker is not None  # not under the request that waited
        residency.release(a, -1.0)
        await _unloads_done(residency)
        assert a.worker is None

    asyncio.run(scenario())
