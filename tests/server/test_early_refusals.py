"""Answers sent before a request's body has been read (401, 403, 413) are read by a client
still sending it, and a body has one deadline, read and drained alike."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from mlxkv import Runner
from mlxkv.server import create_app, middleware
from tests.server.conftest import serve

CHAT = "/v1/chat/completions"
# Far past what the sockets' buffers hold: its sender is still sending when a server that
# answers first has answered.
_BODY = json.dumps({"messages": [{"role": "user", "content": "x" * 2**24}]}).encode()


@pytest.mark.parametrize(
    ("options", "headers", "status"),
    [
        ({"api_key": "secret"}, {}, 401),
        ({}, {"Host": "rebound.example"}, 403),
        ({}, {"Origin": "https://elsewhere.example"}, 403),
        ({"max_body_bytes": 1000}, {}, 413),
    ],
    ids=["api-key", "host", "origin", "body-limit"],
)
def test_urllib_reads_a_refusal_sent_before_its_body(loaded_tiny, options, headers, status):
    """urllib sends `Connection: close`; a 401 or 403 answered before the body was read
    closed the connection under the client still sending, which saw a reset (URLError:
    BrokenPipeError, ConnectionResetError) instead of the answer."""
    with serve(Runner(loaded_tiny("llama")), **options) as served:
        request = urllib.request.Request(served.url + CHAT, _BODY, headers, method="POST")
        request.add_header("Content-Type", "application/json")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=60)
        answer = json.loads(refused.value.read())
    assert refused.value.code == status and answer["error"]["message"]


class _DrippingClient:
    """A chunked body of 10-byte chunks, one every `drip_s` seconds of a clock that only the
    chunks move: the event loop's time, so its deadlines pass without the test waiting."""

    def __init__(self, drip_s: float, num_chunks: int):
        self.now_s = 0.0
        self.drip_s = drip_s
        self.num_chunks = num_chunks
        self.sent = 0
        self.answered_at_s: float | None = None
        self.status: int | None = None

    async def receive(self) -> dict:
        if self.sent == self.num_chunks:  # bounded: the old drain ran to the end
            return {"type": "http.disconnect"}
        self.now_s += self.drip_s
        await asyncio.sleep(0)  # the loop sees the new time: a deadline passed fires
        self.sent += 1
        return {"type": "http.request", "body": b"x" * 10, "more_body": True}

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.answered_at_s, self.status = self.now_s, message["status"]


def _scope() -> dict:
    headers = [(b"host", b"127.0.0.1"), (b"transfer-encoding", b"chunked")]
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": CHAT, "raw_path": CHAT.encode(), "query_string": b"",
        "root_path": "", "headers": headers, "client": ("127.0.0.1", 1), "server": None,
    }  # fmt: skip


def test_an_over_limit_body_dripped_slowly_has_one_deadline(loaded_tiny):
    """The read and the drain share one deadline: past the limit at 110 s, the body is drained
    until `BODY_TIMEOUT_S` and answered 413 (a drain with a deadline of its own held the
    connection to 240 s; the drain nested in the read's timeout answered 408, as if the
    body had not come, when it had come over the limit)."""
    app = create_app(Runner(loaded_tiny("llama")), max_body_bytes=100)
    client = _DrippingClient(drip_s=10.0, num_chunks=1000)
    loop = asyncio.new_event_loop()
    loop.time = lambda: client.now_s  # type: ignore[method-assign]
    try:
        loop.run_until_complete(app(_scope(), client.receive, client.send))
    finally:
        loop.close()
    assert client.status == 413
    assert client.answered_at_s <= middleware.BODY_TIMEOUT_S + client.drip_s, client.answered_at_s
