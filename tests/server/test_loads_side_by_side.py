"""Loads of different models run side by side (a tiny model waited 6.7 s behind SmolLM2's
load): with no memory budget over HTTP, through the real OpenAI client; under a budget that
holds one of them, the second load waits for room instead of overshooting it. Each load is
held by an event around its loader, so "while the other loads" is certain, not timed."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import pytest

from mlxkv import Runner
from mlxkv.server.errors import ApiError
from mlxkv.server.models.model import ModelLoader, ResidentModel
from mlxkv.server.models.resident import Residency
from mlxkv.server.worker import GenerationWorker
from tests.factories import tiny_model_dir
from tests.server.conftest import serve

QUESTION = [{"role": "user", "content": "Once upon a time there was"}]
_TIMEOUT_S = 30.0  # a load that waits for the other's fails on this, not hangs


@dataclass
class _Gated:
    """A factory model whose load starts (`entered`), then waits for `open`."""

    path: str
    open: threading.Event = field(default_factory=threading.Event)
    entered: threading.Event = field(default_factory=threading.Event)
    loads: int = 0

    def loader(self, estimated_bytes: int = 0) -> ModelLoader:
        def load() -> Runner:
            self.loads += 1
            self.entered.set()
            assert self.open.wait(60)
            return _runner(self.path)

        return ModelLoader(load, estimated_bytes)


def _runner(path: str) -> Runner:
    return Runner.load(path, max_context=256, cache_bytes=1 << 20)


async def _footprint_bytes(path: str) -> int:
    """A model's measured footprint (weights and cache budget), from a load not held."""
    probe = Residency([ResidentModel("p", ModelLoader(lambda: _runner(path)))],
                      GenerationWorker, None, -1.0)  # fmt: skip
    await probe.acquire(probe.models[0])
    size = probe.models[0].footprint_bytes
    probe.release(probe.models[0], None)
    probe.shutdown()
    return size


def _gated(model_root: str, *archs: str) -> list[_Gated]:
    return [_Gated(str(tiny_model_dir(arch, model_root))) for arch in archs]


def test_two_models_load_side_by_side_without_a_budget(model_root):
    a, b = _gated(model_root, "llama", "qwen3")
    replies: dict[str, list[str]] = {"a": [], "b": []}

    def ask(client, name: str) -> None:
        reply = client.chat.completions.create(
            model=name, messages=QUESTION, max_tokens=4, temperature=0
        )
        replies[name].append(reply.choices[0].message.content)

    with serve({"a": a.loader(), "b": b.loader()}) as served:
        client = served.openai(timeout=_TIMEOUT_S)
        askers = [threading.Thread(target=ask, args=(client, name)) for name in "aab"]
        try:
            for asker in askers[:2]:  # two requests wait for a's one load
                asker.start()
            assert a.entered.wait(_TIMEOUT_S)
            askers[2].start()
            assert b.entered.wait(_TIMEOUT_S), "b's load waited for a's to end"
            assert not a.open.is_set()  # both loads run at once
        finally:
            a.open.set()
            b.open.set()
            for asker in askers:
                if asker.ident is not None:  # started
                    asker.join(_TIMEOUT_S)
        resident = served.app.state.mlxkv.models.resident
        assert (a.loads, b.loads) == (1, 1)
        assert resident["a"].num_loads == resident["b"].num_loads == 1
        ask(client, "a")  # loaded now: the same greedy reply as the two that waited
        ask(client, "b")
    assert len(set(replies["a"])) == 1 and len(replies["a"]) == 3, replies
    assert len(set(replies["b"])) == 1 and len(replies["b"]) == 2, replies


def test_under_a_budget_for_one_the_second_load_waits_for_room(model_root):
    """The budget holds one model: b's load does not start while a's is held (a's estimate is
    reserved), nor while a's request runs; it starts once a has unloaded."""
    a, b = _gated(model_root, "llama", "qwen3")
    b.open.set()  # b loads as soon as it starts: its start is what is watched

    async def scenario() -> None:
        size = await _footprint_bytes(a.path)  # the tiny models' are about the same
        models = [ResidentModel("a", a.loader(size)), ResidentModel("b", b.loader(size))]
        residency = Residency(models, GenerationWorker, int(size * 1.5), -1.0)
        model_a, model_b = models
        first = asyncio.ensure_future(residency.acquire(model_a))
        await asyncio.to_thread(a.entered.wait, _TIMEOUT_S)
        second = asyncio.ensure_future(residency.acquire(model_b))
        for _ in range(100):  # until b waits for room (nothing else runs on this loop)
            if residency._released._waiters:
                break
            await asyncio.sleep(0)
        assert residency._released._waiters and not b.entered.is_set()
        a.open.set()
        await first  # a's request holds it loaded: b still waits
        assert not b.entered.is_set() and not second.done()
        residency.release(model_a, None)  # a unloads, then b loads
        await second
        assert model_a.worker is None and model_b.worker is not None
        assert residency.used_bytes <= residency.budget_bytes
        residency.release(model_b, None)
        residency.shutdown()

    asyncio.run(scenario())


def test_under_a_budget_a_model_of_unknown_size_loads_alone(model_root):
    """A loader with no estimate (a hub id, an Ollama name) reserves nothing: under a budget
    such a load runs after the loads under way and none starts beside it, so each load makes
    room against the others measured, as when every load waited for the one before."""
    a, b = _gated(model_root, "llama", "qwen3")
    b.open.set()

    async def scenario() -> None:
        models = [ResidentModel("a", a.loader(0)), ResidentModel("b", b.loader(0))]
        residency = Residency(models, GenerationWorker, 1 << 40, -1.0)
        first = asyncio.ensure_future(residency.acquire(models[0]))
        await asyncio.to_thread(a.entered.wait, _TIMEOUT_S)
        second = asyncio.ensure_future(residency.acquire(models[1]))
        for _ in range(100):  # until b waits (nothing else runs on this loop)
            if residency._room._waiters:
                break
            await asyncio.sleep(0)
        assert residency._room._waiters and not b.entered.is_set(), "b loaded beside a"
        a.open.set()
        await first
        await second
        assert b.entered.is_set() and models[1].worker is not None
        for model in models:
            residency.release(model, None)
        residency.shutdown()

    asyncio.run(scenario())


def test_under_a_budget_later_loads_that_fit_go_before_one_waiting_for_room(model_root):
    """b waits for room (a is busy, b's estimate fits only without it): c and d, asked after
    it, fit beside a and load at once; e, which fits too, waits behind b (at most two loads go
    first: b's wait is bounded). Once a, c and d end their requests, b loads, then e."""
    a, b, c, d, e = _gated(model_root, *["llama"] * 5)
    for gated in (a, b, c, d, e):
        gated.open.set()  # which load starts when is watched, not how long each takes

    async def scenario() -> None:
        size = await _footprint_bytes(a.path)
        estimates = {"a": size, "b": 5 * size, "c": size, "d": size, "e": size}
        gates = dict(zip("abcde", (a, b, c, d, e), strict=True))
        models = {n: ResidentModel(n, gates[n].loader(estimates[n])) for n in "abcde"}
        residency = Residency(list(models.values()), GenerationWorker, int(size * 5.5), -1.0)
        await residency.acquire(models["a"])  # busy from here
        waiting = asyncio.ensure_future(residency.acquire(models["b"]))
        for _ in range(100):  # until b waits for room (nothing else runs on this loop)
            if residency._released._waiters:
                break
            await asyncio.sleep(0)
        assert residency._released._waiters and not b.entered.is_set()
        for name in "cd":  # fit beside a: they do not wait for b
            await asyncio.wait_for(residency.acquire(models[name]), _TIMEOUT_S)
        last = asyncio.ensure_future(residency.acquire(models["e"]))
        for _ in range(100):  # until e waits its turn behind b (b's wait and its own)
            if len(residency._released._waiters) == 2:
                break
            await asyncio.sleep(0)
        assert len(residency._released._waiters) == 2, "e did not wait"
        assert not e.entered.is_set(), "a third load went first"
        assert residency.used_bytes <= residency.budget_bytes
        for name in "acd":
            residency.release(models[name], None)
        await asyncio.wait_for(waiting, _TIMEOUT_S)
        await asyncio.wait_for(last, _TIMEOUT_S)
        assert [models[n].num_loads for n in "abcde"] == [1, 1, 1, 1, 1]
        assert models["b"].worker is not None and models["e"].worker is not None
        assert residency.used_bytes <= residency.budget_bytes
        for name in "be":
            residency.release(models[name], None)
        residency.shutdown()

    asyncio.run(scenario())


def test_a_load_whose_requests_all_left_goes_on_in_its_room_and_is_kept(model_root):
    """Every request waiting for a load leaves (their tasks cancelled) while its loader runs:
    the load goes on, its room still reserved (its thread is still taking that memory), and
    its model stays loaded, idle until its keep-alive ends, so the next request finds it
    loaded instead of loading it a second time."""
    (a,) = _gated(model_root, "llama")

    async def scenario() -> None:
        size = await _footprint_bytes(a.path)
        model = ResidentModel("a", a.loader(size))
        residency = Residency([model], GenerationWorker, int(size * 1.5), 300.0)
        waiters = [asyncio.ensure_future(residency.acquire(model)) for _ in range(2)]
        await asyncio.to_thread(a.entered.wait, _TIMEOUT_S)
        for waiter in waiters:
            waiter.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        assert residency._reserved_bytes == size, "the room was given back while it loads"
        a.open.set()
        await asyncio.wait_for(asyncio.shield(model._load_task), _TIMEOUT_S)
        assert model.worker is not None and model.expires_at is not None  # idle, expiring
        assert residency._reserved_bytes == 0 and residency.used_bytes <= residency.budget_bytes
        worker = await residency.acquire(model)
        assert worker is model.worker and (a.loads, model.num_loads) == (1, 1)
        residency.release(model, None)
        residency.shutdown()

    asyncio.run(scenario())


def test_a_load_that_fits_once_one_gone_first_failed_goes_first_then(model_root):
    """b waits for room (a is busy); c fits beside a and goes first; d, asked while c loads,
    does not fit beside both and waits. c's load fails: its room frees and d fits beside a,
    so d goes first then, instead of waiting for a's request and then b's."""
    a, b, d = _gated(model_root, "llama", "llama", "llama")
    for gated in (a, b, d):
        gated.open.set()
    c_entered, c_may_fail = threading.Event(), threading.Event()

    def c_load() -> Runner:
        c_entered.set()
        assert c_may_fail.wait(60)
        raise OSError("c broke")

    async def scenario() -> None:
        size = await _footprint_bytes(a.path)
        models = {
            "a": ResidentModel("a", a.loader(size)),
            "b": ResidentModel("b", b.loader(5 * size)),
            "c": ResidentModel("c", ModelLoader(c_load, size)),
            "d": ResidentModel("d", d.loader(4 * size)),
        }
        residency = Residency(list(models.values()), GenerationWorker, int(size * 5.5), -1.0)
        await residency.acquire(models["a"])  # busy from here
        waiting = asyncio.ensure_future(residency.acquire(models["b"]))
        for _ in range(100):  # until b waits for room (nothing else runs on this loop)
            if residency._waiting_for_room == "b":
                break
            await asyncio.sleep(0)
        assert residency._waiting_for_room == "b"
        failing = asyncio.ensure_future(residency.acquire(models["c"]))
        await asyncio.to_thread(c_entered.wait, _TIMEOUT_S)
        later = asyncio.ensure_future(residency.acquire(models["d"]))
        for _ in range(100):  # until d waits (it does not fit beside a and c's room)
            await asyncio.sleep(0)
        assert not d.entered.is_set()
        c_may_fail.set()
        with pytest.raises(ApiError, match="failed to load: c broke"):
            await failing
        # before: d waited for a's request and then b's to end
        await asyncio.wait_for(later, _TIMEOUT_S)
        assert not waiting.done() and models["a"].in_flight == 1
        assert residency.used_bytes + residency._reserved_bytes <= residency.budget_bytes
        for name in "ad":
            residency.release(models[name], None)
        await asyncio.wait_for(waiting, _TIMEOUT_S)
        residency.release(models["b"], None)
        residency.shutdown()

    asyncio.run(scenario())
