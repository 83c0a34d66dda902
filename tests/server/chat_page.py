"""What the chat page's tests share (test_chat_page*.py; their fixtures, a headless Chromium
and a server with the tiny model, are in conftest.py): the browser's flags, and the steps a
test takes on the page."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator

import pytest

from mlxkv import Runner

WAIT_MS = 30_000
MAX_CONTEXT = 8192
# Flags for a closed network: no background connections, no first-run work.
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    # Private Network Access blocks a public page's requests to loopback; Firefox and Safari
    # send them: off, this Chromium shows what those let a cross-site page do.
    "--disable-features=BlockInsecurePrivateNetworkRequests,PrivateNetworkAccessSendPreflights,"
    "PrivateNetworkAccessRespectPreflightResults,LocalNetworkAccessChecks",
]


def chromium_path() -> str:
    found = os.environ.get("MLXKV_CHROMIUM") or shutil.which("chromium")
    if found:
        return found
    message = "no Chromium: install Debian's chromium package (or set MLXKV_CHROMIUM)"
    if os.environ.get("CI"):  # CI installs it: a missing browser is a failure there
        pytest.fail(message)
    pytest.skip(message)


class Paced:
    """The model with a pause before each forward pass: the tiny model writes a whole reply in
    a few milliseconds, which the browser may read in one piece; a real model's reply streams
    over many reads, and so does this one's."""

    def __init__(self, model, pause_s: float):
        self._model = model
        self._pause_s = pause_s

    def __call__(self, *args, **kwargs):
        time.sleep(self._pause_s)
        return self._model(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._model, name)


def _fresh(loaded_tiny) -> Runner:
    return Runner(loaded_tiny("llama"), max_context=MAX_CONTEXT)


def _set(page, selector: str, value: str) -> None:
    page.locator("#settings").evaluate("el => el.open = true")
    page.fill(selector, value)


def _send(page, text: str) -> None:
    """Sends a message and waits until its reply has ended (its stats or an error shown)."""
    before = page.locator(".message.assistant:not(.pending)").count()
    page.fill("#input", text)
    page.press("#input", "Enter")
    page.locator(".message.assistant:not(.pending)").nth(before).wait_for()


def _stored(page) -> dict:
    return page.evaluate("JSON.parse(localStorage.getItem('mlxkv.chats.v1'))")


def _current(page) -> dict:
    store = _stored(page)
    return next(chat for chat in store["chats"] if chat["id"] == store["current"])


def _api_messages(chat: dict) -> list[dict]:
    return [{"role": m["role"], "content": m["content"]} for m in chat["messages"]]


def _wait_until_idle(runner: Runner) -> None:
    """The server's generation has ended (the cancelled one included)."""
    runner.cache_tokens  # waits for a running generation  # noqa: B018


@contextlib.contextmanager
def open_page(browser, url: str, ready: str | None = None) -> Iterator:
    """A fresh browser context (empty local storage) on the page at `url`, once `ready` (a
    selector) shows, if given."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    try:
        opened = context.new_page()
        opened.set_default_timeout(WAIT_MS)
        opened.goto(url)
        if ready is not None:
            opened.locator(ready).wait_for()
        yield opened
    finally:
        context.close()
