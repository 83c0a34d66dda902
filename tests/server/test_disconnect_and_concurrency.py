"""Clients that leave early cancel their generation; clients at once get sequential answers."""

from __future__ import annotations

import http.client
import json
import logging
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

LONG = 900  # tokens asked for; the tiny model runs them in a second or two
QUESTION = [{"role": "user", "content": "Once upon a time there was"}]
_WAIT_S = 30


@pytest.fixture
def access_log(caplog):
    caplog.set_level(logging.INFO, logger="mlxkv.server.access")

    def wait_for(pattern: str) -> re.Match:
        deadline = time.monotonic() + _WAIT_S
        while time.monotonic() < deadline:
            for record in caplog.records:
                if found := re.search(pattern, record.getMessage()):
                    return found
            time.sleep(0.02)
        raise AssertionError(f"no access line matched {pattern!r}")

    return wait_for


@pytest.fixture
def never_ends(fresh_runner):
    """A prompt whose greedy answer runs to LONG tokens (checked), so only a cancel ends it
    early."""
    reference = fresh_runner().generate(QUESTION, max_tokens=LONG)
    assert reference.finish_reason == "length"
    return QUESTION


def _open(served, path: str, body: dict, timeout: float = 60) -> http.client.HTTPConnection:
    connection = http.client.HTTPConnection(served.host, served.port, timeout=timeout)
    data = json.dumps(body).encode()
    connection.request("POST", path, body=data, headers={"Content-Type": "application/json"})
    return connection


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_leaving_a_stream_cancels_it_and_the_next_answer_is_a_fresh_runners(
    tiny_server, fresh_runner, never_ends, access_log, path
):
    body = {"messages": never_ends, "max_tokens": LONG, "stream": True}
    connection = _open(tiny_server, path, body)
    response = connection.getresponse()
    lines = [response.readline() for _ in range(8)]  # a few events
    assert any(b"data:" in line for line in lines)
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    cancelled = access_log(rf"POST {path} 200 .* generated=(\d+) .*finish=cancelled")
    assert int(cancelled.group(1)) < LONG
    reference = fresh_runner().generate(QUESTION, max_tokens=12)
    after = tiny_server.openai().chat.completions.create(
        model="m", messages=QUESTION, max_tokens=12
    )
    assert after.choices[0].message.content == reference.text


def test_a_client_that_times_out_cancels_a_plain_request(tiny_server, never_ends, access_log):
    connection = _open(
        tiny_server, "/v1/chat/completions", {"messages": never_ends, "max_tokens": LONG}, 0.3
    )
    with pytest.raises(TimeoutError):
        connection.getresponse()
    connection.close()
    cancelled = access_log(r"POST /v1/chat/completions \d+ .* generated=(\d+) .*finish=cancelled")
    assert int(cancelled.group(1)) < LONG


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


def test_the_access_line_reports_speculative_acceptance(tiny_server, fresh_runner, access_log):
    prompt = "one two three four five six seven eight nine ten. " * 6  # drafts from itself
    reference = fresh_runner().generate(prompt, max_tokens=40)  # "auto", as the server runs
    assert reference.drafted_tokens > 0
    tiny_server.openai().completions.create(model="m", prompt=prompt, max_tokens=40)
    found = access_log(r"POST /v1/completions 200 .* drafted=(\d+) accepted=(\d+) \((\d+)%\)")
    drafted, accepted, share = (int(n) for n in found.groups())
    assert (drafted, accepted) == (reference.drafted_tokens, reference.accepted_tokens)
    assert share == round(100 * accepted / drafted)
