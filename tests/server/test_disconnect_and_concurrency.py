"""Clients that leave early cancel their generation; clients at once get sequential answers."""

from __future__ import annotations

import dataclasses
import http.client
import json
import signal
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

from mlxkv import Runner
from mlxkv.models.loading import load_model
from tests.factories import GatedModel, wait_until
from tests.server.conftest import SCRIPT, serve

LONG = 900  # tokens asked for: far more than run before the gate holds the model
HELD_AFTER = 4  # forward passes a stream left mid-reply runs before the gate holds it
QUESTION = [{"role": "user", "content": "Once upon a time there was"}]


@pytest.fixture
def gated_server(loaded_tiny, fresh_runner):
    """The tiny llama behind a server, its model held by a gate the test controls; the
    question's first tokens are not EOS (checked), so a held generation is still running."""
    assert fresh_runner().generate(QUESTION, max_tokens=8).finish_reason == "length"
    loaded = loaded_tiny("llama")
    gate = GatedModel(loaded.model)
    runner = Runner(dataclasses.replace(loaded, model=gate), max_context=1024)
    try:
        with serve(runner) as served:
            yield served, gate
    finally:
        gate.release()


def _cancel_requested(runner) -> bool:
    return any(event.is_set() for event in list(runner._dispatch._requests))


def _open(served, path: str, body: dict, timeout: float = 60) -> http.client.HTTPConnection:
    connection = http.client.HTTPConnection(served.host, served.port, timeout=timeout)
    data = json.dumps(body).encode()
    connection.request("POST", path, body=data, headers={"Content-Type": "application/json"})
    return connection


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_leaving_a_stream_cancels_it_and_the_next_answer_is_a_fresh_runners(
    gated_server, fresh_runner, access_log, path
):
    served, gate = gated_server
    gate.hold_after(HELD_AFTER)  # prefill, then a few tokens streamed, then held mid-reply
    body = {"messages": QUESTION, "max_tokens": LONG, "stream": True}
    connection = _open(served, path, body)
    response = connection.getresponse()
    while b"delta" not in response.readline():  # the first streamed text
        pass
    assert gate.reached.wait(30)
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    wait_until(lambda: _cancel_requested(served.runner), what="the server's cancel")
    gate.release()
    cancelled = access_log(rf"POST {path} 200 .* generated=(\d+) .*finish=cancelled")
    # within a decode step: no token past the held forward pass (4 let through, the prefill's
    # among them), not merely fewer than asked for
    assert int(cancelled.group(1)) <= HELD_AFTER
    reference = fresh_runner().generate(QUESTION, max_tokens=12)
    after = served.openai().chat.completions.create(model="m", messages=QUESTION, max_tokens=12)
    assert after.choices[0].message.content == reference.text


def _given_up_while_held(served, gate, forward_passes: int) -> None:
    """A plain request whose client gives up while the model is held after `forward_passes`;
    returns once the server cancelled it and the model runs on."""
    gate.hold_after(forward_passes)
    body = {"messages": QUESTION, "max_tokens": LONG}
    connection = _open(served, "/v1/chat/completions", body, timeout=0.3)
    with pytest.raises(TimeoutError):
        connection.getresponse()
    connection.close()
    wait_until(lambda: _cancel_requested(served.runner), what="the server's cancel")
    gate.release()


def test_a_client_that_times_out_cancels_a_plain_request(gated_server, access_log):
    served, gate = gated_server
    # held mid-reply: the answer cannot come before the client gives up
    _given_up_while_held(served, gate, forward_passes=3)
    cancelled = access_log(r"POST /v1/chat/completions \d+ .* generated=(\d+) .*finish=cancelled")
    assert int(cancelled.group(1)) < LONG


def test_a_request_cancelled_before_its_first_token_logs_no_time_to_it(gated_server, access_log):
    """The access line's ttft is the time to the first token; a request cancelled in its
    prefill has none (it showed the time until the cancel took effect, longer than the
    request's own duration)."""
    served, gate = gated_server
    _given_up_while_held(served, gate, forward_passes=0)  # the prefill waits
    access_log(r"POST /v1/chat/completions \d+ .* generated=0 ttft=none finish=cancelled")


def test_four_clients_at_once_get_their_sequential_answers(tiny_server):
    prompts = [
        [{"role": "user", "content": text}]
        for text in ("The cache holds", "Paris is", "def f(x):", "The quick brown fox")
    ]

    def ask(messages):
        out = tiny_server.openai().chat.completions.create(
            model="m", messages=messages, max_tokens=24
        )
        return out.choices[0].message.content

    sequential = [ask(messages) for messages in prompts]
    with ThreadPoolExecutor(4) as pool:
        concurrent = list(pool.map(ask, prompts))
    assert concurrent == sequential
    assert len(set(sequential)) > 1  # the prompts really differ


def test_the_access_line_reports_speculative_acceptance(scripted_dir, access_log):
    runner = Runner(load_model(scripted_dir), max_context=1024)  # "auto", as the server runs
    # The scripted answer quoted in the prompt: n-gram lookup drafts its later pieces.
    prompt = [{"role": "user", "content": "Say: " + "".join(SCRIPT)}]
    reference = Runner(load_model(scripted_dir), max_context=1024).generate(prompt, max_tokens=40)
    assert reference.drafted_tokens > 0
    with serve(runner) as served:
        served.openai().chat.completions.create(model="m", messages=prompt, max_tokens=40)
    found = access_log(r"POST /v1/chat/completions 200 .* drafted=(\d+) accepted=(\d+) \((\d+)%\)")
    drafted, accepted, share = (int(n) for n in found.groups())
    assert (drafted, accepted) == (reference.drafted_tokens, reference.accepted_tokens)
    assert share == round(100 * accepted / drafted)


@pytest.mark.parametrize(
    "path", ["/v1/chat/completions", "/v1/messages"], ids=["openai", "anthropic"]
)
def test_a_stream_running_at_shutdown_ends_with_an_error_event(gated_server, access_log, path):
    """Stopping the server (SIGTERM, Ctrl-C) ends a running stream with the API's error
    event at once, instead of leaving it to be cut by uvicorn's graceful timeout."""
    served, gate = gated_server
    gate.hold_after(4)
    body = {"model": "m", "messages": QUESTION, "max_tokens": LONG, "stream": True}
    running = _open(served, path, body)
    response = running.getresponse()
    assert gate.reached.wait(30)  # mid-reply
    waiting = _open(served, path, body)  # queued behind it
    queued = waiting.getresponse()
    served.server.handle_exit(signal.SIGTERM, None)  # what the signal handler calls
    gate.release()
    for reply, connection in ((response, running), (queued, waiting)):
        events = reply.read().decode()
        connection.close()
        assert "the server is shutting down" in events.rsplit("data: ", 2)[-1], events[-300:]
    access_log(rf"POST {path} 200 .*finish=cancelled")
