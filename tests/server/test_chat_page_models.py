"""The chat page on a server of several models: it lists them, each conversation talks to the
model chosen for it (a reply equal to a fresh Runner of that model's), the cache panel shows
that model's cache, and a deleted conversation frees its entries in every model it used.
With one model there is nothing to choose (the picker stays hidden)."""

from __future__ import annotations

import pytest

from mlxkv import Runner
from mlxkv.server.models.model import ModelLoader
from tests.factories import tiny_model_dir

from .chat_page import WAIT_MS, _current, _send, _set, open_page
from .conftest import serve

ARCHS = {"first": "llama", "second": "qwen3"}
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def served(loaded_tiny):
    runners = {name: Runner(loaded_tiny(arch), max_context=512) for name, arch in ARCHS.items()}
    with serve(runners) as served:
        yield served


@pytest.fixture
def two_models(browser, served):
    with open_page(browser, served.url + "/", ready="#model") as opened:  # models listed
        yield opened


def _reply_alone(loaded_tiny, name: str, text: str) -> str:
    """An independent reference: a fresh Runner of one model, with an empty cache."""
    runner = Runner(loaded_tiny(ARCHS[name]), max_context=512)
    return runner.generate([{"role": "user", "content": text}], max_tokens=MAX_TOKENS).text


def _sent(page, text: str) -> dict:
    with page.expect_request("**/v1/chat/completions") as request:
        _send(page, text)
    return request.value.post_data_json


def test_each_conversation_talks_to_the_model_chosen_for_it(two_models, served, loaded_tiny):
    page = two_models
    assert page.locator("#model option").all_inner_texts() == list(ARCHS)
    _set(page, "#max-tokens", str(MAX_TOKENS))
    assert _sent(page, "Hello there")["model"] == "first"  # the server's default, named
    assert _current(page)["messages"][1]["content"] == _reply_alone(
        loaded_tiny, "first", "Hello there"
    )

    page.click("#new-chat")
    page.select_option("#model", "second")
    assert _sent(page, "Hello there")["model"] == "second"
    assert _current(page)["messages"][1]["content"] == _reply_alone(
        loaded_tiny, "second", "Hello there"
    )
    page.locator("#cache-summary", has_text="second").wait_for()  # the panel follows the model

    page.locator("#conversations li:not(.selected) .open").click()  # back to the first
    assert page.locator("#model").input_value() == "first"
    page.locator("#cache-summary", has_text="first").wait_for()
    page.click("#new-chat")  # a new conversation takes the last model chosen
    assert page.locator("#model").input_value() == "second"


def test_a_deleted_conversation_frees_its_entries_in_every_model_it_used(two_models, served):
    page = two_models
    _set(page, "#max-tokens", str(MAX_TOKENS))
    page.select_option("#model", "first")
    _send(page, "On the first model")
    page.select_option("#model", "second")
    _send(page, "Then on the second")
    chat_id = _current(page)["id"]
    runners = served.runner
    for runner in runners.values():
        runner.cache_tokens  # the generation has ended  # noqa: B018
        assert chat_id in [entry.label for entry in runner.cache_info().entries]

    page.locator(f"#conversations li[data-id='{chat_id}'] .delete").click()
    for name, runner in runners.items():
        page.wait_for_function(  # each model's DELETE has been answered
            "(name) => performance.getEntriesByType('resource').some("
            "(e) => e.name.includes('/v1/mlxkv/cache/') && e.name.endsWith('model=' + name))",
            arg=name,
        )
        assert chat_id not in [entry.label for entry in runner.cache_info().entries], name


def test_with_one_model_there_is_nothing_to_choose(page, page_server):
    _set(page, "#max-tokens", str(MAX_TOKENS))
    _send(page, "Hello there")
    assert page.locator("#model").is_hidden()
    assert page.locator("#model option").count() == 1


def test_a_model_not_loaded_is_said_so_and_not_polled(browser, loaded_tiny, model_root):
    """Its cache report is a 409 (it loads on its first request): said once in the panel, not
    asked again every poll (each 409 was a console error), and read again once it answers."""
    path = tiny_model_dir("qwen3", model_root)
    loader = ModelLoader(lambda: Runner.load(str(path), max_context=512), path=path)
    runners = {"first": Runner(loaded_tiny("llama"), max_context=512), "later": loader}
    with serve(runners) as served:
        context = browser.new_context(viewport={"width": 1280, "height": 800})
        page = context.new_page()
        page.set_default_timeout(WAIT_MS)
        page.clock.install()  # the poll's timers run when the test says
        asked = []
        page.on("request", lambda r: asked.append(r.url) if "mlxkv/cache" in r.url else None)
        page.goto(served.url + "/")
        page.locator("#model").wait_for()
        page.select_option("#model", "later")
        page.locator("#cache-summary", has_text="not loaded").wait_for()
        before = len(asked)
        page.clock.run_for(10 * 2000)  # five polls' time
        assert len(asked) == before
        _set(page, "#max-tokens", str(MAX_TOKENS))
        _send(page, "Hello there")  # loads it
        page.locator("#cache-summary", has_text="later").wait_for()
        context.close()
