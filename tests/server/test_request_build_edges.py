"""Review probes of the worker's start (the building thread starts the generation): clients
that leave while their request is built, bad requests in each API's shape, and many clients
at once through the real `openai` and `anthropic` clients, with nothing left in use after."""

from __future__ import annotations

import gc
import http.client
import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from mlxkv import Runner
from tests.factories import wait_until
from tests.server.conftest import serve

LONG = 400
QUESTION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Once upon a time there was"},
]


@pytest.fixture
def served(loaded_tiny):
    with serve(Runner(loaded_tiny("llama"), max_context=1024)) as running:
        yield running


def _idle(served) -> bool:
    """Nothing pending, claimed or registered for cancelling. A generation abandoned before
    it started (closed unstarted: its `finally` never runs) leaves its cancel event in the
    dispatcher's WeakSet until a cycle collection frees it: collected first."""
    gc.collect()
    worker = served.app.state.mlxkv.worker
    pool = served.runner._pool
    return worker._pending == 0 and not pool._in_use and not served.runner._dispatch._requests


def _open(served, path: str, body: dict) -> http.client.HTTPConnection:
    connection = http.client.HTTPConnection(served.host, served.port, timeout=60)
    data = json.dumps(body).encode()
    connection.request("POST", path, body=data, headers={"Content-Type": "application/json"})
    return connection


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_a_client_that_leaves_while_its_request_is_built_leaves_nothing_running(
    served, access_log, path, stream
):
    building, release = threading.Event(), threading.Event()
    builder = served.runner._builder
    build = builder.build

    def held_build(*args, **kwargs):
        building.set()
        release.wait(30)
        return build(*args, **kwargs)

    builder.build = held_build
    body = {"model": "m", "messages": QUESTION, "max_tokens": LONG, "stream": stream}
    connection = _open(served, path, body)
    assert building.wait(30)
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    release.set()
    wait_until(lambda: _idle(served), what="the server idle again")
    ended = access_log(rf"POST {path} \d+ .* generated=(\d+) .*finish=(\w+)")
    assert int(ended.group(1)) < LONG and ended.group(2) == "cancelled", ended.group(0)
    builder.build = build
    after = served.openai().chat.completions.create(model="m", messages=QUESTION, max_tokens=4)
    assert after.choices[0].finish_reason in ("stop", "length")


BAD = [
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ({"messages": QUESTION, "chat_template_kwargs": "thinking"}, "switches"),
    ({"messages": QUESTION, "max_tokens": 10**9, "truncate": False}, None),
    ({"messages": [{"role": "user", "content": "x" * 9000}], "max_tokens": 4}, None),
]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
def test_bad_requests_are_4xx_in_the_apis_shape(served, path, stream):
    for body, _ in BAD:
        status, answer = served.post(
            path, {"model": "m", "max_tokens": 4, **body, "stream": stream}
        )
        if status == 200:  # taken (cut to the window, or the setting ignored): fine
            continue
        assert 400 <= status < 500, (body, status, answer)
        assert isinstance(answer, dict), answer
        if path == "/v1/messages":
            assert answer["type"] == "error" and answer["error"]["message"], answer
        else:
            assert answer["error"]["message"], answer
        assert "Traceback" not in json.dumps(answer)
    wait_until(lambda: _idle(served), what="the server idle again")


def test_many_clients_at_once_some_leaving_leave_nothing_in_use(served, fresh_runner):
    texts = ["The cache holds", "Paris is", "def f(x):", "The quick brown fox"]

    def ask(i: int) -> str | None:
        messages = [QUESTION[0], {"role": "user", "content": texts[i % len(texts)]}]
        if i % 4 == 0:
            out = served.openai().chat.completions.create(
                model="m", messages=messages, max_tokens=16
            )
            return out.choices[0].message.content
        if i % 4 == 1:
            reply = served.anthropic().messages.create(
                model="m", system=messages[0]["content"], messages=messages[1:], max_tokens=16
            )
            return reply.content[0].text if reply.content else ""
        if i % 4 == 2:  # a stream left after its first chunk
            chunks = served.openai().chat.completions.create(
                model="m", messages=messages, max_tokens=LONG, stream=True
            )
            next(iter(chunks))
            chunks.close()
            return None
        with (
            served.anthropic().messages.stream(  # read to the end, slowly
                model="m", system=messages[0]["content"], messages=messages[1:], max_tokens=16
            ) as events
        ):
            for _ in events.text_stream:
                threading.Event().wait(0.01)
            return events.get_final_message().content[0].text

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(16)))
    wait_until(lambda: _idle(served), what="the server idle again")
    reference = fresh_runner()
    for i, answer in enumerate(answers):
        if answer is None:
            continue
        messages = [QUESTION[0], {"role": "user", "content": texts[i % len(texts)]}]
        assert answer == reference.generate(messages, max_tokens=16).text, i
