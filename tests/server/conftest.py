"""A real server (uvicorn on 127.0.0.1, an ephemeral port, its own thread) per app, and the
real OpenAI and Anthropic clients pointed at it; for the chat page's tests, a headless
Chromium and a page on a server of the tiny model."""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import anthropic
import openai
import pytest
from fastapi import FastAPI

from mlxkv import Runner
from mlxkv.config import ServerConfig
from mlxkv.server import create_app
from mlxkv.server.connections import Server, uvicorn_config
from mlxkv.testing.factory import TOOLS_CHAT_TEMPLATE, build_scripted_model

from .chat_page import CHROMIUM_ARGS, MAX_CONTEXT, Paced, chromium_path, open_page

TOOL_CALL = '{"name":"get_weather","arguments":{"city":"Paris"}}'
# The function TOOL_CALL calls, as a request's tool definition.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
SCRIPT = ("Let", "<tool_call>", TOOL_CALL, "</tool_call>")
# Qwen3's thinking switch (off renders an empty thought after the generation prompt), and
# assistant turns rendering the thinking sent back with them (`reasoning_content`), as
# Qwen3's template does for the turns of the current tool loop.
THINKING_TEMPLATE = TOOLS_CHAT_TEMPLATE.replace(
    "<|im_start|>assistant\n{{ message['content'] }}",
    "<|im_start|>assistant\n{% if message.reasoning_content %}"
    "<think>{{ message.reasoning_content }}</think>{% endif %}{{ message['content'] }}",
).replace(
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think></think>"
    "{% endif %}{% endif %}",
)
# DeepSeek-R1's (and Qwen3's thinking-only models'): the generation prompt opens the thought.
OPENING_TEMPLATE = THINKING_TEMPLATE.replace(
    "</think>{% endif %}{% endif %}", "</think>{% else %}<think>{% endif %}{% endif %}"
)
_START_TIMEOUT_S = 30


@dataclass
class Served:
    """A running server: its address, its Runner, and clients for it."""

    host: str
    port: int
    runner: Runner
    app: FastAPI
    server: Server

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def openai(self, **kwargs) -> openai.OpenAI:
        options = {"api_key": "unused", "max_retries": 0, **kwargs}
        return openai.OpenAI(base_url=f"{self.url}/v1", **options)

    def anthropic(self, **kwargs) -> anthropic.Anthropic:
        options = {"api_key": "unused", "max_retries": 0, **kwargs}
        return anthropic.Anthropic(base_url=self.url, **options)

    def post(self, path: str, body: bytes | dict | list | str, headers: dict | None = None):
        """Raw POST (for bodies no client would send): (status, parsed JSON or text)."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return self.request("POST", path, data, headers)

    def response_headers(self, path: str) -> dict[str, str]:
        """A GET's response headers, names in lower case."""
        connection = http.client.HTTPConnection(self.host, self.port, timeout=60)
        try:
            connection.request("GET", path)
            response = connection.getresponse()
            response.read()
            return {name.lower(): value for name, value in response.getheaders()}
        finally:
            connection.close()

    def request(self, method: str, path: str, data: bytes | None = None, headers=None):
        connection = http.client.HTTPConnection(self.host, self.port, timeout=60)
        try:
            connection.request(
                method,
                path,
                body=data,
                headers={"Content-Type": "application/json", **(headers or {})},
            )
            response = connection.getresponse()
            raw = response.read().decode()
        finally:
            connection.close()
        try:
            return response.status, json.loads(raw)
        except json.JSONDecodeError:
            return response.status, raw


def build_template_model(path: Path, script: tuple[str, ...], template: str) -> Path:
    """`build_scripted_model` with another chat template: the script follows the last token of
    the generation prompt, so a template that ends it with a piece starts the script there."""
    out = build_scripted_model(path, script)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": template}))
    return out


@contextlib.contextmanager
def serve(runner: Runner | dict[str, Runner], **app_options) -> Iterator[Served]:
    """Serves `runner` until the block ends; the port is picked by the OS."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = ServerConfig.of(None, app_options)
    app = create_app(runner, config)
    server = Server(uvicorn_config(app, config))  # as `mlxkv serve` runs it
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield Served("127.0.0.1", port, runner, app, server)
    finally:
        server.should_exit = True
        thread.join(timeout=_START_TIMEOUT_S)
        sock.close()


@contextlib.contextmanager
def held_worker(served: Served) -> Iterator[threading.Event]:
    """Every place of the server's worker taken (requests ahead of everyone, as many as its
    batch holds) until the event is set: a request sent meanwhile waits for its turn."""
    worker = served.app.state.mlxkv.worker
    release = threading.Event()
    for _ in range(worker.runner.max_batch):
        worker._executor.submit(release.wait, 60)
    try:
        yield release
    finally:
        release.set()


def held_until_left(monkeypatch, runner, leaves_after: Callable[[dict], int | None]) -> None:
    """A server stream whose client leaves after reading some pieces (`leaves_after` of its
    `Runner.stream` options: how many; None for a client that reads to the end) waits after
    its chunk with that many texts until the client has left (its cancel set): the client
    leaves mid-reply, not after a reply the server's worker read to its end meanwhile (it
    reads on, whatever the client's pace)."""
    stream = runner.stream

    def held(*args, **kwargs):
        chunks, shown = stream(*args, **kwargs), leaves_after(kwargs)
        return chunks if shown is None else _until_cancelled(chunks, kwargs["cancel"], shown)

    monkeypatch.setattr(runner, "stream", held)


def _until_cancelled(chunks: Iterable, cancel: threading.Event, shown: int) -> Iterator:
    with contextlib.closing(iter(chunks)) as items:
        texts = 0
        for chunk in items:
            yield chunk
            texts += bool(chunk.text)
            if texts == shown:
                assert cancel.wait(60), f"the client did not leave after {shown} pieces"


@pytest.fixture(scope="session")
def scripted_dir(tmp_path_factory):
    """A model that answers every chat with SCRIPT (text, then one tool call) when greedy."""
    return build_scripted_model(tmp_path_factory.mktemp("scripted") / "model", SCRIPT)


@pytest.fixture(scope="session")
def tiny_server(loaded_tiny):
    """The tiny random llama behind a server (its answers are deterministic when greedy)."""
    with serve(Runner(loaded_tiny("llama"), max_context=1024)) as served:
        yield served


@pytest.fixture(scope="module")
def module_server(loaded_tiny):
    """`tiny_server`, one per test module: what its requests keep on the server (stored
    responses, conversations, the cache) is the module's alone."""
    with serve(Runner(loaded_tiny("llama"), max_context=1024)) as served:
        yield served


@pytest.fixture
def fresh_runner(loaded_tiny):
    """An independent reference: a new Runner on the same weights, with an empty cache."""
    return lambda **kw: Runner(loaded_tiny("llama"), **{"max_context": 1024, **kw})


@pytest.fixture(scope="module")
def browser():
    """A headless Chromium for the chat page's tests (skipped without Playwright)."""
    playwright_api = pytest.importorskip("playwright.sync_api")
    with playwright_api.sync_playwright() as driver:
        launched = driver.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def page_server(loaded_tiny):
    loaded = loaded_tiny("llama")
    paced = dataclasses.replace(loaded, model=Paced(loaded.model, pause_s=0.015))
    runner = Runner(paced, max_context=MAX_CONTEXT, cache_entries=4)
    with serve(runner) as served:
        yield served


@pytest.fixture
def page(browser, page_server):
    """A fresh browser context (empty local storage) on the chat page."""
    with open_page(browser, page_server.url + "/") as opened:
        yield opened
