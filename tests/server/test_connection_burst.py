"""A burst of more connections than may wait for their headers at once
(`connections.MAX_WAITING_CONNECTIONS`): every client gets an HTTP answer. Those turned away
read a 503 with Retry-After, in the shape of the API their request line named, and no
connection is reset (100 clients at once saw 10 resets when the oldest were closed)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import socket
import threading

import anthropic

from mlxkv import Runner
from mlxkv.server import connections
from tests.factories import joined, wait_until
from tests.server.conftest import serve

MAX_WAITING = 4
NUM_SOCKETS = 24
HEALTH = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"


def _answer(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (a reset raises)."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def _waiting(served) -> list:
    """The server's connections waiting for their headers (read from the test's thread)."""
    return list(getattr(served.server.server_state, "mlxkv_waiting", {}))


def test_every_connection_of_a_burst_gets_an_answer(loaded_tiny, monkeypatch):
    monkeypatch.setattr(connections, "MAX_WAITING_CONNECTIONS", MAX_WAITING)
    with (
        serve(Runner(loaded_tiny("llama"))) as served,
        contextlib.ExitStack() as held,
    ):
        address = (served.host, served.port)
        first = held.enter_context(socket.create_connection(address, timeout=30))
        first.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\n")  # headers begun
        wait_until(lambda: any(c.conn.trailing_data[0] for c in _waiting(served)))
        rest = [
            held.enter_context(socket.create_connection(address, timeout=30))
            for _ in range(NUM_SOCKETS - 1)
        ]
        # all accepted (in order: the last one too) before any of them sends its request
        last = rest[-1].getsockname()[1]
        wait_until(lambda: last in {c.client[1] for c in _waiting(served)})
        for sock in rest:
            sock.sendall(HEALTH)
        answers = [_answer(sock) for sock in rest]
        first_answer = _answer(first)
    assert all(a.startswith((b"HTTP/1.1 200 ", b"HTTP/1.1 503 ")) for a in answers), answers
    busy = [a for a in answers if a.startswith(b"HTTP/1.1 503 ")]
    assert len(busy) == NUM_SOCKETS - MAX_WAITING - 1
    assert all(b"\r\nretry-after: 1\r\n" in a.lower() for a in [*busy, first_answer])
    assert json.loads(busy[0].split(b"\r\n\r\n", 1)[1])["error"]["type"] == "server_error"
    head, body = first_answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 503 ")
    assert json.loads(body)["error"]["type"] == "overloaded_error"  # Anthropic's shape


def test_a_burst_whose_headers_arrive_before_it_is_accepted_is_bounded(loaded_tiny, monkeypatch):
    """Sockets that sent their partial headers before the server accepted them all were
    skipped as "a request already sent" when the bound was checked, and never checked again
    once read: 140 of a burst of 300 waited, and 2,100 took the server to its open-file limit
    (accept failed with EMFILE). Here the server's event loop is held while the burst
    connects and sends, so every one of them is accepted with its bytes unread."""
    monkeypatch.setattr(connections, "MAX_WAITING_CONNECTIONS", MAX_WAITING)
    with (
        serve(Runner(loaded_tiny("llama"))) as served,
        contextlib.ExitStack() as held,
    ):
        address = (served.host, served.port)
        first = held.enter_context(socket.create_connection(address, timeout=30))
        wait_until(lambda: _waiting(served), what="the first connection waiting")
        entered, release = threading.Event(), threading.Event()
        held.callback(release.set)

        def hold_the_loop() -> None:
            entered.set()
            release.wait(30)

        _waiting(served)[0].loop.call_soon_threadsafe(hold_the_loop)
        assert entered.wait(30), "the server's event loop was not held"
        rest = [
            held.enter_context(socket.create_connection(address, timeout=30))
            for _ in range(NUM_SOCKETS - 1)
        ]
        for sock in [first, *rest]:
            sock.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\n")  # headers begun
        release.set()
        # each one read: waiting with its bytes, or turned away (lingering)
        wait_until(
            lambda: (
                sum(bool(c.conn.trailing_data[0]) for c in _waiting(served))
                + len(getattr(served.server.server_state, "mlxkv_lingering", ()))
                >= NUM_SOCKETS
            ),
            what="every connection of the burst read",
        )
        assert len(_waiting(served)) <= MAX_WAITING, len(_waiting(served))


def test_a_burst_of_100_requests_at_once_is_answered_without_a_reset(loaded_tiny):
    """As measured: 100 clients at once, each opening and sending at its own pace."""

    def ask(_: int) -> bytes:
        with socket.create_connection((served.host, served.port), timeout=60) as sock:
            sock.sendall(HEALTH)
            return _answer(sock)

    with (
        serve(Runner(loaded_tiny("llama"))) as served,
        concurrent.futures.ThreadPoolExecutor(100) as pool,
    ):
        answers = list(pool.map(ask, range(100)))
    assert all(a.startswith((b"HTTP/1.1 200 ", b"HTTP/1.1 503 ")) for a in answers)


def _relay_holding_back_the_blank_line(listener: socket.socket, server: tuple) -> None:
    """Relays one client's request to `server` without the blank line that ends its headers
    (the request waits for them, as one cut between packets would), then the answer back."""
    client, _ = listener.accept()
    with client, socket.create_connection(server, timeout=30) as upstream:
        request = b""
        while b"\r\n\r\n" not in request and (chunk := client.recv(65536)):
            request += chunk
        upstream.sendall(request[: request.index(b"\r\n\r\n") + 2])
        client.sendall(_answer(upstream))


def test_a_turned_away_anthropic_client_reads_the_503_in_its_api_shape(loaded_tiny, monkeypatch):
    """`/v1/models` is OpenAI's path too: a client whose header lines that came carry
    `anthropic-version` is answered in Anthropic's shape, as requests read whole are (was
    OpenAI's, chosen from the path alone). Through the real SDK: its own typed error."""
    monkeypatch.setattr(connections, "MAX_WAITING_CONNECTIONS", 1)
    refused: list[Exception] = []

    def list_models(url: str) -> None:
        client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        try:
            client.models.list()
        except anthropic.APIError as error:
            refused.append(error)

    with (
        serve(Runner(loaded_tiny("llama"))) as served,
        socket.create_server(("127.0.0.1", 0)) as listener,
        contextlib.ExitStack() as held,
    ):
        server = (served.host, served.port)
        relay = threading.Thread(target=_relay_holding_back_the_blank_line, args=(listener, server))
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        sdk = threading.Thread(target=list_models, args=(url,))
        relay.start()
        sdk.start()
        wait_until(
            lambda: any(b"anthropic-version" in c.conn.trailing_data[0] for c in _waiting(served))
        )
        held.enter_context(socket.create_connection(server, timeout=30))  # one waiting too many
        joined(relay, sdk)
    assert len(refused) == 1, "the listing was not refused"
    error = refused[0]
    assert isinstance(error, anthropic.ServiceUnavailableError), error
    assert error.body["type"] == "error"
    assert error.body["error"]["type"] == "overloaded_error"
    assert error.body["error"]["message"].startswith("over 1 connections were waiting")
    assert error.response.headers["retry-after"] == str(connections.RETRY_AFTER_S)
