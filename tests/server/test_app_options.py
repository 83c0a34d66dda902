"""create_app's options: /health, CORS origins, the default answer length, errors mid-stream."""

from __future__ import annotations

import http.client

from mlxkv import Runner
from tests.server.conftest import serve

USER = [{"role": "user", "content": "Once upon a time there was"}]


def test_health_reports_the_model_and_the_cache(tiny_server):
    tiny_server.openai().chat.completions.create(model="m", messages=USER, max_tokens=2)
    status, body = tiny_server.request("GET", "/health")
    assert status == 200 and body["status"] == "ok"
    assert body["model"] == tiny_server.runner.loaded.path.name
    assert body["cache"]["tokens"] == tiny_server.runner.cache_info().num_tokens > 0


def test_health_is_503_when_the_runner_cannot_serve(loaded_tiny, monkeypatch):
    """A sharded Runner whose ranks fell out of step fails every request: /health says so
    (it used to answer ok while every request hung)."""
    runner = Runner(loaded_tiny("llama"))
    with serve(runner) as served:
        monkeypatch.setattr(Runner, "health", property(lambda self: "ranks out of step"))
        status, body = served.request("GET", "/health")
    assert status == 503 and body == {"status": "error", "error": "ranks out of step"}


def _preflight(served, origin: str) -> http.client.HTTPResponse:
    connection = http.client.HTTPConnection(served.host, served.port, timeout=30)
    connection.request(
        "OPTIONS",
        "/v1/chat/completions",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    response = connection.getresponse()
    response.read()
    connection.close()
    return response


def test_cors_allows_only_the_named_origins(loaded_tiny):
    with serve(Runner(loaded_tiny("llama")), cors_origins=["http://localhost:3000"]) as served:
        allowed = _preflight(served, "http://localhost:3000")
        assert allowed.status == 200
        assert allowed.getheader("access-control-allow-origin") == "http://localhost:3000"
        other = _preflight(served, "http://evil.example")
        assert other.getheader("access-control-allow-origin") is None


def test_without_cors_origins_no_browser_origin_is_allowed(tiny_server):
    response = _preflight(tiny_server, "http://localhost:3000")
    assert response.getheader("access-control-allow-origin") is None


def test_default_max_tokens_applies_when_the_request_sets_none(loaded_tiny, fresh_runner):
    reference = fresh_runner().generate(USER, max_tokens=5)
    assert reference.finish_reason == "length"
    with serve(Runner(loaded_tiny("llama")), default_max_tokens=5) as served:
        out = served.openai().chat.completions.create(model="m", messages=USER)
    assert out.usage.completion_tokens == 5
    assert out.choices[0].message.content == reference.text


def test_a_generation_that_fails_mid_stream_ends_with_an_error_event(loaded_tiny, monkeypatch):
    runner = Runner(loaded_tiny("llama"))
    stream = runner.stream

    def failing_stream(*args, **kwargs):
        chunks = stream(*args, **kwargs)

        def generate():
            yield next(chunks)
            chunks.close()
            raise RuntimeError("device lost")

        return generate()

    monkeypatch.setattr(runner, "stream", failing_stream)
    with serve(runner) as served:
        status, text = served.post(
            "/v1/chat/completions", {"messages": USER, "max_tokens": 8, "stream": True}
        )
        assert status == 200
        assert '"server_error"' in text and "RuntimeError" in text
        status, text = served.post(
            "/v1/messages", {"messages": USER, "max_tokens": 8, "stream": True}
        )
        assert "event: error" in text and '"api_error"' in text
        status, body = served.post("/v1/chat/completions", {"messages": USER, "max_tokens": 8})
        assert status == 500 and body["error"]["type"] == "server_error"
