"""What keeps one client from holding the server: a bounded queue (429 with Retry-After), a
queue wait that ends, a stream whose reader stopped is cancelled, a per-request token limit,
bounded messages, and deadlines for headers and bodies with a connection limit."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import http.client
import json
import socket
import threading
from collections.abc import Iterator

import anthropic
import openai
import pytest

from mlxkv import Runner
from mlxkv.config import ServerConfig
from mlxkv.server import connections, middleware, worker
from tests.factories import wait_until
from tests.server.conftest import held_worker, serve

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


@contextlib.contextmanager
def _open_stream(served) -> Iterator[http.client.HTTPResponse]:
    connection = http.client.HTTPConnection(served.host, served.port, timeout=60)
    body = {"messages": USER, "max_tokens": 2, "stream": True}
    connection.request("POST", CHAT, json.dumps(body), {"Content-Type": "application/json"})
    try:
        yield connection.getresponse()  # its status: accepted, queued behind the block
    finally:
        connection.close()


def test_a_full_queue_is_429_with_retry_after(loaded_tiny):
    with (
        serve(Runner(loaded_tiny("llama")), max_queue=2) as served,
        held_worker(served),
        _open_stream(served) as first,
        _open_stream(served) as second,
    ):
        assert first.status == second.status == 200
        connection = http.client.HTTPConnection(served.host, served.port, timeout=60)
        connection.request("POST", CHAT, json.dumps({"messages": USER}),
                           {"Content-Type": "application/json"})  # fmt: skip
        response = connection.getresponse()
        body = json.loads(response.read())
        connection.close()
    assert response.status == 429 and response.getheader("Retry-After") == "5"
    assert "limit is 2" in body["error"]["message"]


def test_requests_abandoned_while_waiting_free_their_place(loaded_tiny):
    """A client that sends a request and leaves at once, again and again, must not fill the
    queue with work nobody will read while the worker is busy."""
    with serve(Runner(loaded_tiny("llama")), max_queue=2) as served, held_worker(served):
        worker_ = served.app.state.mlxkv.worker
        for _ in range(5):
            with _open_stream(served) as response:
                assert response.status == 200
            wait_until(lambda: worker_._pending == 0, what="the abandoned request's place freed")
        with _open_stream(served) as response:
            assert response.status == 200


def test_a_request_that_waited_too_long_gets_503_when_the_wait_runs_out(loaded_tiny):
    with serve(Runner(loaded_tiny("llama"))) as served, held_worker(served):
        served.app.state.mlxkv.worker.queue_timeout_s = 0.05
        status, body = served.post(CHAT, {"messages": USER})  # while the worker is still busy
    assert status == 503 and "waited" in body["error"]["message"]


def test_a_reader_that_stopped_reading_is_cancelled(monkeypatch):
    monkeypatch.setattr(worker, "STALLED_CHUNKS", 3)
    monkeypatch.setattr(worker, "STALLED_READER_S", 0.0)
    cancel = threading.Event()
    made = []

    def chunks():
        while not cancel.is_set() and len(made) < 1000:
            made.append(object())
            yield _Chunk()

    async def never_read() -> None:
        stream = worker.GenerationStream(chunks(), cancel)
        await asyncio.get_running_loop().run_in_executor(None, stream.pump)

    asyncio.run(never_read())
    assert cancel.is_set() and len(made) <= 5


class _Chunk:
    completion = None


def test_the_token_limit_refuses_an_ask_and_caps_the_default(loaded_tiny):
    with serve(Runner(loaded_tiny("llama")), max_tokens_limit=4) as served:
        status, body = served.post(CHAT, {"messages": USER, "max_tokens": 20})
        assert status == 400 and "limit of 4" in body["error"]["message"]
        status, body = served.post(CHAT, {"messages": USER, "temperature": 0})
        assert status == 200 and body["usage"]["completion_tokens"] <= 4


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT, {"messages": [{"role": "user", "content": ""}] * 100_001}),
        ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "c",
                                      "output": ""}] * 100_001}),
        ("/v1/messages", {"max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "text", "text": ""}] * 200_001}]}),
    ],
    ids=["messages", "responses-items", "content-blocks"],
)  # fmt: skip
def test_too_many_values_are_refused_before_parsing(tiny_server, path, body):
    status, answer = tiny_server.post(path, body)
    message = json.dumps(answer)
    assert status == 400 and "JSON objects, arrays and elements" in message, message[:300]


def test_unclosed_quotes_do_not_stall_the_server(tiny_server):
    """A regex over strings took 34 s on 128 KB of escaped quotes, on the event loop."""
    status, _ = tiny_server.post(CHAT, b'"' + b'\\"' * 500_000)
    assert status == 400


@pytest.mark.parametrize(
    ("sent", "answer"),
    [(b"", b""), (b"POST /v1/models HTTP/1.1\r\nHost: x\r\n", b"HTTP/1.1 408 ")],
    ids=["nothing", "half-the-headers"],
)
def test_headers_that_do_not_arrive_close_the_connection(loaded_tiny, monkeypatch, sent, answer):
    """A request begun is answered 408 (was: closed without a word, as is a socket that sent
    nothing)."""
    monkeypatch.setattr(connections, "HEADER_TIMEOUT_S", 0.2)
    with (
        serve(Runner(loaded_tiny("llama"))) as served,
        socket.create_connection((served.host, served.port), timeout=30) as idle,
    ):
        idle.sendall(sent)
        received = b""
        while chunk := idle.recv(1024):  # closed by the server, not by the 30 s timeout
            received += chunk
    assert received.startswith(answer) and (answer or not received), received
    if answer:
        head, _, body = received.partition(b"\r\n\r\n")
        assert b"connection: close" in head.lower()
        assert b"did not arrive within 0.2 s" in body


def test_a_body_that_does_not_arrive_is_408(loaded_tiny, monkeypatch):
    monkeypatch.setattr(middleware, "BODY_TIMEOUT_S", 0.2)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    )
    with (
        serve(Runner(loaded_tiny("llama"))) as served,
        socket.create_connection((served.host, served.port), timeout=30) as slow,
    ):
        slow.sendall(head + b'{"m')  # 3 of the 100 bytes promised
        assert slow.recv(1024).startswith(b"HTTP/1.1 408 ")


def test_idle_sockets_cannot_fill_the_connection_limit(loaded_tiny, monkeypatch):
    """256 sockets that sent nothing made every request a 503 until the header deadline; now
    the oldest waiting one is turned away (answered 503, then closed) when too many wait."""
    monkeypatch.setattr(connections, "MAX_WAITING_CONNECTIONS", 2)
    with (
        serve(Runner(loaded_tiny("llama")), max_connections=2) as served,
        contextlib.ExitStack() as held,
    ):
        idle = [
            held.enter_context(socket.create_connection((served.host, served.port), timeout=30))
            for _ in range(6)
        ]
        assert served.request("GET", "/health")[0] == 200
        for sock in idle[:4]:  # the oldest, answered and closed
            assert sock.recv(65536).startswith(b"HTTP/1.1 503 ")
            assert sock.recv(1) == b""


def test_connections_over_the_limit_get_503(loaded_tiny, monkeypatch):
    monkeypatch.setattr(connections, "MAX_WAITING_CONNECTIONS", 1)
    with (
        serve(Runner(loaded_tiny("llama")), max_connections=2) as served,
        contextlib.ExitStack() as held,
    ):
        for _ in range(2):  # kept alive after their request: counted as open connections
            kept = http.client.HTTPConnection(served.host, served.port, timeout=30)
            held.callback(kept.close)
            kept.request("GET", "/health")
            kept.getresponse().read()
        held.enter_context(socket.create_connection((served.host, served.port)))  # waiting
        status, _ = served.request("GET", "/health")
        with pytest.raises(anthropic.InternalServerError) as refused:
            served.anthropic().messages.create(model="tiny", messages=USER, max_tokens=1)
        with pytest.raises(openai.InternalServerError) as openai_refused:
            served.openai().models.list()
    assert status == 503
    # in the API's shape, with Retry-After, as the server's own 503s (was: uvicorn's plain text)
    assert refused.value.status_code == 503
    assert refused.value.response.headers["retry-after"] == str(connections.RETRY_AFTER_S)
    assert refused.value.body["error"]["type"] == "overloaded_error"
    assert openai_refused.value.body["message"].startswith("the server has all the 3 connections")
    assert openai_refused.value.response.headers["connection"] == "close"


def _sixteen_mib_chunks() -> Iterator[bytes]:
    """A body far past what the sockets' buffers hold: its sender is still sending when a
    server that answers first has answered."""
    yield b'{"messages": [{"role": "user", "content": "'
    for _ in range(16):
        yield b"x" * 2**20
    yield b'"}]}'


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_client_that_asks_to_close_reads_the_413(loaded_tiny, framing):
    """urllib sends `Connection: close`; the server answered 413 before reading the body and
    closed with the body unread, so the client, still sending, saw a reset (BrokenPipeError,
    ConnectionResetError) instead of the answer."""
    body = b"".join(_sixteen_mib_chunks())
    with serve(Runner(loaded_tiny("llama")), max_body_bytes=1000) as served:
        connection = http.client.HTTPConnection(served.host, served.port, timeout=60)
        headers = {"Content-Type": "application/json", "Connection": "close"}
        if framing == "chunked":
            connection.request("POST", CHAT, _sixteen_mib_chunks(), headers, encode_chunked=True)
        else:
            connection.request("POST", CHAT, body, headers)
        response = connection.getresponse()
        answer = json.loads(response.read())
        connection.close()
        assert served.post(CHAT, {"messages": USER, "max_tokens": 1})[0] == 200
    assert response.status == 413 and "--max-body-bytes" in answer["error"]["message"]


def test_a_client_that_waits_for_100_continue_is_refused_before_it_sends(loaded_tiny):
    """curl sends `Expect: 100-continue` before a body over 1 MiB: the 413 comes at once and
    no `100 Continue` asks for a body that would only be thrown away."""
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: 16777216\r\n"
        b"Expect: 100-continue\r\nConnection: close\r\n\r\n"
    )
    with (
        serve(Runner(loaded_tiny("llama")), max_body_bytes=1000) as served,
        socket.create_connection((served.host, served.port), timeout=30) as client,
    ):
        client.sendall(head)
        assert client.recv(1024).startswith(b"HTTP/1.1 413 ")


def test_a_request_sent_before_a_burst_of_idle_sockets_is_answered(loaded_tiny, monkeypatch):
    """A request whose bytes had arrived but were not read yet when more than
    `MAX_WAITING_CONNECTIONS` others opened was closed as the oldest waiting connection
    (load_test: a client's first request, opened beside its 64 idle sockets)."""
    monkeypatch.setattr(connections, "MAX_WAITING_CONNECTIONS", 4)
    with serve(Runner(loaded_tiny("llama"))) as served:
        for _ in range(5):
            connection = http.client.HTTPConnection(served.host, served.port, timeout=30)
            connection.request("POST", CHAT, b'{"messages": [')  # sent: in the server's socket
            with contextlib.ExitStack() as held:
                for _ in range(16):
                    held.enter_context(socket.create_connection((served.host, served.port)))
                assert connection.getresponse().status == 400
            connection.close()


def test_running_out_of_open_files_is_one_log_line(caplog):
    """A burst of ~2,100 sockets took the server to its open-file limit, and asyncio logged
    the failed accept with a traceback (once a minute); the server's log says it in one line."""
    connections.uvicorn_config(object(), ServerConfig.of(None, {}))
    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level("ERROR", logger="asyncio"):
            loop.call_exception_handler(
                {
                    "message": "socket.accept() out of system resource",
                    "exception": OSError(errno.EMFILE, "Too many open files"),
                }
            )
    finally:
        loop.close()
    [record] = [r for r in caplog.records if r.name == "asyncio"]
    assert record.exc_info is None and "\n" not in record.getMessage(), record.getMessage()
    assert "Too many open files" in record.getMessage()


def test_other_os_errors_on_the_loop_keep_their_traceback(caplog):
    """Only the failed accept is shortened: an OSError raised by our own callbacks is a bug
    whose traceback is the one thing to read."""
    connections.uvicorn_config(object(), ServerConfig.of(None, {}))
    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level("ERROR", logger="asyncio"):
            loop.call_exception_handler(
                {"message": "Exception in callback", "exception": OSError(errno.EBADF, "x")}
            )
    finally:
        loop.close()
    [record] = [r for r in caplog.records if r.name == "asyncio"]
    assert record.exc_info is not None
