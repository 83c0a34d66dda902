"""Models served by name and loaded on their first request, through the real clients: nothing is
loaded at start (`/api/ps` empty, `/api/tags` and `/v1/models` list every model), a request
loads its model (answering as a fresh Runner of it alone), `keep_alive: 0` unloads it after the
reply and a later request reloads it warm from its disk tier."""

from __future__ import annotations

import gc
import json
import os
import threading
import weakref
from datetime import UTC, datetime

import numpy as np
import ollama
import pytest

from mlxkv import Runner
from mlxkv.server.models.model import ModelLoader
from tests.factories import tiny_model_dir, wait_until
from tests.server.conftest import serve

QUESTION = [{"role": "user", "content": "Once upon a time there was"}]
ARCHS = {"a": "llama", "b": "qwen3"}
OPTIONS = {"temperature": 0, "num_predict": 6}


class _Closed(Runner):
    closed: threading.Event

    def close(self, save_timeout_s=None) -> None:
        super().close(save_timeout_s)
        self.closed.set()


@pytest.fixture
def served(model_root, tmp_path):
    closed = {name: threading.Event() for name in ARCHS}
    made: list[weakref.ref[Runner]] = []

    def loader(name: str) -> ModelLoader:
        path = tiny_model_dir(ARCHS[name], model_root)

        def load() -> Runner:
            runner = _Closed.load(str(path), max_context=512, cache_dir=tmp_path / "kv")
            runner.closed = closed[name]
            made.append(weakref.ref(runner))
            return runner

        return ModelLoader(load, path=path)  # its family is known before it loads

    sources = {name: loader(name) for name in ARCHS}
    with serve(sources, model_aliases=("claude-*=b",)) as served:
        served.closed, served.made = closed, made
        yield served


def _loaded(served) -> list[str]:
    return [m.model for m in ollama.Client(host=served.url).ps().models]


def test_nothing_loads_before_its_first_request(served):
    client = ollama.Client(host=served.url)
    assert _loaded(served) == []
    assert [m.model for m in client.list().models] == ["a:latest", "b:latest"]
    assert [m.id for m in served.openai().models.list()] == ["a", "b"]
    reply = client.chat(model="b", messages=QUESTION, options=OPTIONS)
    assert reply.message.content
    (shown,) = client.ps().models
    assert shown.model == "b:latest" and shown.size > 0
    assert shown.expires_at > datetime.now(UTC)  # the default keep-alive: 5 minutes


def test_keep_alive_zero_unloads_and_the_next_request_loads_it_warm(served, model_root):
    client = ollama.Client(host=served.url)
    first = client.chat(model="a", messages=QUESTION, options=OPTIONS, keep_alive=0)
    assert served.closed["a"].wait(60)  # its entries written to its disk tier
    wait_until(lambda: _loaded(served) == [], what="model a unloading")
    history = [*QUESTION, {"role": "assistant", "content": first.message.content}]
    follow = [*history, {"role": "user", "content": "And then?"}]
    reply = served.openai().chat.completions.create(
        model="a", messages=follow, max_tokens=4, temperature=0, logprobs=True
    )
    assert _loaded(served) == ["a:latest"]
    # the reply's ids come back from the disk tier with its blocks: the whole turn is reused
    # (less the reply's last token, which a reply cut by max_tokens never fed)
    cached = reply.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.prompt_eval_count + first.eval_count - 1
    # the reloaded model renders the reply as the ids it generated (`disk.replies`): a model
    # loaded afresh, without a cache, answers those ids as it does
    rendered = served.app.state.mlxkv.models.resident["a"].worker.runner.encode(follow)
    assert reply.usage.prompt_tokens == len(rendered)
    fresh = Runner.load(str(tiny_model_dir(ARCHS["a"], model_root)), max_context=512)
    want = list(fresh.stream(rendered, max_tokens=4, temperature=0, logprobs=0))
    got = [token.logprob for token in reply.choices[0].logprobs.content]
    expected = [c.logprob.logprob for c in want if c.logprob]
    np.testing.assert_allclose(got, expected[: len(got)], atol=1e-4)


def test_a_model_loaded_again_without_a_disk_tier_knows_its_replies(model_root):
    """Unloaded by `keep_alive: 0` and loaded again (a new tokenizer, so a new reply memory),
    with no disk tier to read records from: the reply sent back still renders as the ids the
    first load generated, as a model never unloaded renders it."""
    path = tiny_model_dir(ARCHS["a"], model_root)
    loads: list[Runner] = []

    def load() -> Runner:
        loads.append(Runner.load(str(path), max_context=512))
        return loads[-1]

    with serve({"a": ModelLoader(load, path=path)}) as s:
        client = ollama.Client(host=s.url)
        first = client.chat(model="a", messages=QUESTION, options=OPTIONS, keep_alive=0)
        wait_until(lambda: _loaded(s) == [], what="model a unloading")
        history = [*QUESTION, {"role": "assistant", "content": first.message.content}]
        follow = [*history, {"role": "user", "content": "And then?"}]
        second = client.chat(model="a", messages=follow, options=OPTIONS)
    assert len(loads) == 2
    as_generated = loads[0].encode(follow)  # the first load knows the reply it generated
    fresh = Runner.load(str(path), max_context=512)  # knows none: the reply as text
    assert len(fresh.encode(follow)) != len(as_generated)  # the case at hand
    assert second.prompt_eval_count == len(as_generated)


def test_ollamas_unload_request_unloads(served):
    client = ollama.Client(host=served.url)
    client.generate(model="b", prompt="Hi", options=OPTIONS)
    assert _loaded(served) == ["b:latest"]
    reply = client.chat(model="a", messages=[], keep_alive=0)  # a model not loaded
    assert reply.done_reason == "unload"
    assert served.app.state.mlxkv.models.resident["a"].num_loads == 0  # not loaded for it
    reply = client.generate(model="b", keep_alive=0)  # no prompt: Ollama's unload
    assert reply.done_reason == "unload"
    assert served.closed["b"].wait(60)
    wait_until(lambda: _loaded(served) == [], what="model b unloading")


def test_show_and_pull_resolve_aliases(served):
    client = ollama.Client(host=served.url)
    assert client.show("claude-sonnet-4-5").details.family == "qwen3"  # not loaded for it
    assert served.app.state.mlxkv.models.resident["b"].num_loads == 0
    assert client.pull("claude-sonnet-4-5").status == "success"
    with pytest.raises(ollama.ResponseError, match="serves: a, b"):
        client.show("gpt-4o")


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("DELETE", "/api/delete", {"model": "b"}),
        ("POST", "/api/copy", {"source": "b", "destination": "x"}),
        ("POST", "/api/create", {"model": "x", "from": "b"}),
        ("POST", "/api/push", {"model": "a"}),
    ],
    ids=["delete", "copy", "create", "push"],
)
def test_model_management_is_refused_without_loading_a_model(served, method, path, body):
    """A 501 loads nothing (under --max-memory a load unloads another model) and names
    every model served, not one as if it were the only one."""
    status, reply = served.request(method, path, json.dumps(body).encode())
    assert status == 501
    assert "a:latest, b:latest" in reply["error"] and "only" not in reply["error"]
    assert _loaded(served) == []


@pytest.mark.parametrize("api", ["ollama", "openai"])
def test_a_connection_kept_open_keeps_nothing_of_a_model_unloaded(served, api):
    """Clients keep their connection open between requests (SDKs pool them), and uvicorn
    holds the connection's last request meanwhile: a model reached from it (the request's
    context, its turn) stayed in memory after it unloaded (515 MiB of SmolLM2's, fuzz22)."""
    served.server.config.timeout_keep_alive = 60  # its connections idle longer than the test
    first = ollama.Client(host=served.url) if api == "ollama" else served.openai()
    if api == "ollama":
        first.chat(model="a", messages=QUESTION, options=OPTIONS)
    else:
        first.chat.completions.create(model="a", messages=QUESTION, max_tokens=2)
    ollama.Client(host=served.url).chat(model="a", messages=[], keep_alive=0)  # unloads it
    (runner,) = served.made
    wait_until(lambda: gc.collect() >= 0 and runner() is None, 10, "the Runner to be freed")
    assert first is not None  # its connection open all along


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_loading_and_unloading_again_and_again_leaves_no_threads(served):
    client = ollama.Client(host=served.url)

    def cycle() -> None:
        client.generate(model="a", prompt="Hi", options=OPTIONS, keep_alive=0)
        wait_until(lambda: _loaded(served) == [], what="model a unloading")

    cycle()
    before = _os_threads()
    for _ in range(5):
        cycle()
    assert _os_threads() <= before + 1


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_pulling_a_served_model_loads_nothing(served, stream):
    """`ollama pull NAME` of a model served answers success as Ollama does for one it has;
    under --max-memory a load would unload another model."""
    client = ollama.Client(host=served.url)
    if stream:
        assert [part.status for part in client.pull("b", stream=True)][-1] == "success"
    else:
        assert client.pull("b").status == "success"
    assert _loaded(served) == []
    with pytest.raises(ollama.ResponseError):
        client.pull("nope")
