"""JSON whatever its Content-Type (what Ollama's clients, LiteLLM's `ollama/` provider and
`curl -d` send), and the Origin check that keeps a page on another site from using that:
the raw requests those clients send, and a browser's cross-site one."""

from __future__ import annotations

import http.client
import json

import pytest

from mlxkv import Runner
from tests.server.conftest import serve

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "stream": False}
OPTIONS = {"num_predict": 3, "temperature": 0}


@pytest.fixture(scope="module")
def served(loaded_tiny):
    runner = Runner(loaded_tiny("llama"), max_context=256)
    with serve(runner, allowed_origins=("https://chat.example.com",)) as s:
        yield s


@pytest.mark.parametrize(
    "content_type",
    [None, "application/x-www-form-urlencoded", "text/plain;charset=UTF-8"],
    ids=["none (litellm ollama/, requests data=)", "form (curl -d)", "text"],
)
def test_json_is_read_whatever_the_content_type(served, content_type):
    body = {**CHAT, "options": OPTIONS}
    expected_status, expected = served.post("/api/chat", body)
    if content_type is None:
        status, answer = _without_content_type(served, "/api/chat", body)
    else:
        headers = {"Content-Type": content_type}
        status, answer = served.request("POST", "/api/chat", json.dumps(body).encode(), headers)
    assert (status, expected_status) == (200, 200)
    assert answer["message"]["content"] == expected["message"]["content"]


def _without_content_type(served, path, body):
    """A POST with no Content-Type header at all (`Served.request` always sends one)."""
    connection = http.client.HTTPConnection(served.host, served.port, timeout=60)
    try:
        connection.putrequest("POST", path)
        data = json.dumps(body).encode()
        connection.putheader("Content-Length", str(len(data)))
        connection.endheaders(data)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_litellm_ollama_chat_request_is_answered(served):
    """What LiteLLM's `ollama_chat/` provider posts (its own httpx call with `data=`): no
    Content-Type, `options` and `format` as Ollama takes them."""
    body = {**CHAT, "options": OPTIONS, "format": "json"}
    status, answer = _without_content_type(served, "/api/chat", body)
    assert status == 200 and isinstance(json.loads(answer["message"]["content"]), dict)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api/chat", {**CHAT, "options": OPTIONS}),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 3}),
        ("/v1/messages", {**CHAT, "max_tokens": 3}),
    ],
    ids=["ollama", "openai", "anthropic"],
)
def test_a_cross_site_page_is_refused_in_the_apis_shape(served, access_log, path, body):
    headers = {"Content-Type": "text/plain", "Origin": "http://evil.example"}
    status, answer = served.request("POST", path, json.dumps(body).encode(), headers)
    assert status == 403
    message = answer["error"] if path.startswith("/api/") else answer["error"]["message"]
    assert "http://evil.example" in message and "--allowed-origin" in message
    if path == "/v1/messages":
        assert answer["type"] == "error" and answer["error"]["type"] == "permission_error"
    line = access_log(rf"POST {path} 403").string
    assert "reason=" in line and "evil.example" in line


@pytest.mark.parametrize(
    "origin",
    [
        "http://localhost:3000",
        "http://127.0.0.1",
        "http://[::1]:5173",
        "https://chat.example.com",
        "HTTPS://Chat.Example.com",
        "vscode-webview://abc",
    ],
    ids=["localhost", "ipv4", "ipv6", "allowed", "case", "editor"],
)
def test_trusted_origins_are_answered(served, origin):
    status, _ = served.post("/api/chat", {**CHAT, "options": OPTIONS}, {"Origin": origin})
    assert status == 200


@pytest.mark.parametrize(
    "origin",
    [
        "null",
        "https://chat.example.com.evil.example",
        "http://localhost.evil.example",
        "http://[::1",
    ],
)
def test_lookalike_and_opaque_origins_are_refused(served, origin):
    status, _ = served.post("/api/chat", {**CHAT, "options": OPTIONS}, {"Origin": origin})
    assert status == 403


def test_the_servers_own_page_is_answered_under_any_name(loaded_tiny):
    """A server bound to every address is reached as http://box.lan:PORT: its page's Origin
    names the Host it was loaded from."""
    with serve(Runner(loaded_tiny("llama"), max_context=256), host="0.0.0.0") as served:
        headers = {"Host": "box.lan:8080", "Origin": "http://box.lan:8080"}
        assert served.post("/api/chat", {**CHAT, "options": OPTIONS}, headers)[0] == 200
        headers["Origin"] = "http://other.lan:8080"
        assert served.post("/api/chat", {**CHAT, "options": OPTIONS}, headers)[0] == 403


def test_any_origin_when_allowed(loaded_tiny):
    with serve(Runner(loaded_tiny("llama"), max_context=256), allowed_origins=("*",)) as served:
        headers = {"Origin": "http://evil.example"}
        assert served.post("/api/chat", {**CHAT, "options": OPTIONS}, headers)[0] == 200


def test_a_refusal_logs_its_reason_escaped(served, access_log):
    served.post("/v1/chat/completions", {"messages": "x\ny"})
    line = access_log(r"POST /v1/chat/completions 400.*").string
    assert "\n" not in line and 'reason="invalid request: messages' in line
