"""The chat page in a real headless Chromium (Debian's `chromium`, driven by Playwright),
against a server with a factory model. Replies and cached-token counts are checked against a
fresh Runner given the same messages; screenshots (light, dark, narrow) are saved as test
artifacts under $MLXKV_TEST_ARTIFACTS (default `test-artifacts/`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from mlxkv import Runner
from mlxkv.models.loading import load_model

from .chat_page import (
    MAX_CONTEXT,
    _api_messages,
    _current,
    _fresh,
    _send,
    _set,
    _stored,
    _wait_until_idle,
    open_page,
)
from .conftest import THINKING_TEMPLATE, build_template_model, serve

ARTIFACTS = Path(os.environ.get("MLXKV_TEST_ARTIFACTS", "test-artifacts"))


def test_reply_streams_and_second_turn_reports_the_cached_tokens(page, loaded_tiny):
    _set(page, "#max-tokens", "24")
    # Count the reply's updates: a streamed reply is drawn more than once.
    page.evaluate(
        """() => { window.updates = 0; new MutationObserver(() => window.updates++)
            .observe(document.querySelector('#messages'), {childList: true, subtree: true}); }"""
    )
    _send(page, "Hello there")
    first = _current(page)["messages"]
    assert page.evaluate("window.updates") > 5
    reference = _fresh(loaded_tiny)
    expected = reference.generate([{"role": "user", "content": "Hello there"}], max_tokens=24)
    assert first[1]["content"] == expected.text
    assert first[1]["stats"]["cached"] == 0

    _send(page, "And then?")
    chat = _current(page)
    second = reference.generate(_api_messages(chat)[:-1], max_tokens=24)
    assert chat["messages"][-1]["content"] == second.text
    stats = chat["messages"][-1]["stats"]
    assert stats["cached"] == second.cached_tokens > 0
    shown = page.locator(".message.assistant").nth(1).locator("[data-stat=cached]").inner_text()
    assert shown == f"cached {second.cached_tokens}"
    assert stats["prompt"] == second.prompt_tokens
    assert stats["ttft_s"] > 0 and stats["tps"] > 0


def test_stop_ends_a_long_reply_and_the_next_message_works(page, page_server, loaded_tiny):
    _set(page, "#max-tokens", "6000")
    page.fill("#input", "Once upon a time there was")
    page.press("#input", "Enter")
    page.wait_for_function(  # some of the reply has streamed
        """() => { const b = document.querySelector('.message.assistant.pending .bubble');
            return b && !b.querySelector('.typing') && b.textContent.trim().length > 0; }"""
    )
    page.click("#stop")
    page.locator(".message.assistant .stopped").wait_for()
    assert page.locator("#send").is_visible()
    _wait_until_idle(page_server.runner)
    stopped = _current(page)["messages"][1]
    assert stopped["stopped"] and "stats" not in stopped

    _set(page, "#max-tokens", "16")
    _send(page, "Go on.")
    chat = _current(page)
    reply = chat["messages"][-1]
    assert "error" not in reply and not reply.get("stopped")
    # The cache the cancel left behind gives what a fresh runner gives for the same chat.
    expected = _fresh(loaded_tiny).generate(_api_messages(chat)[:-1], max_tokens=16)
    assert reply["content"] == expected.text
    assert reply["stats"]["cached"] > 0


def test_switching_conversations_comes_back_and_the_panel_shows_their_entries(page, page_server):
    _set(page, "#max-tokens", "12")
    _send(page, "First conversation")
    first_id = _stored(page)["current"]
    page.click("#new-chat")
    _send(page, "Second conversation")
    assert page.locator("#conversations li").count() == 2

    page.locator(f"#conversations li[data-id='{first_id}'] .open").click()
    assert page.locator(".message.user .bubble").first.inner_text() == "First conversation"
    _send(page, "Back to the first")
    stats = _current(page)["messages"][-1]["stats"]
    assert stats["cached"] > 0  # its entry was kept while the other conversation ran

    page.click("#toggle-cache")  # closes the panel
    page.click("#toggle-cache")  # opens it again, with a fresh reading
    table = page.locator("#cache-entries tbody")
    table.locator("tr", has_text="Second conversation").wait_for()
    rows = table.locator("tr").all_inner_texts()
    assert any("First conversation" in row for row in rows)
    assert any("Second conversation" in row for row in rows)
    report = page_server.runner.cache_info()
    assert page.locator("[data-field=num_tokens]").inner_text() == f"{report.num_tokens:,}"
    assert page.locator("#chart rect.bar").count() == 2  # two turns in this conversation

    _screenshots(page)


def _labels(runner: Runner) -> list[str | None]:
    """The labels of the entries the page's report lists (no `cache_salt` tenant's)."""
    return [entry.label for entry in runner.cache_info().entries if not entry.isolated]


def test_a_conversation_deleted_here_frees_its_cache_entry_and_no_other(page, page_server):
    """No later request reuses a deleted conversation's entry: the page has the server free
    it (its `prompt_cache_key` labels it), and the other conversation's entry stays."""
    _set(page, "#max-tokens", "8")
    _send(page, "Kept conversation")
    kept_id = _stored(page)["current"]
    page.click("#new-chat")
    _send(page, "Soon deleted")
    deleted_id = _stored(page)["current"]
    _wait_until_idle(page_server.runner)
    assert {kept_id, deleted_id} <= set(_labels(page_server.runner))

    with page.expect_response(lambda response: response.request.method == "DELETE") as done:
        page.locator(f"#conversations li[data-id='{deleted_id}'] .delete").click()
    assert done.value.json() == {"cache_key": deleted_id, "dropped_entries": 1}
    labels = _labels(page_server.runner)
    assert deleted_id not in labels and kept_id in labels
    table = page.locator("#cache-entries tbody")
    table.locator("tr", has_text="Kept conversation").wait_for()  # the panel's refresh
    assert table.locator("tr", has_text="Soon deleted").count() == 0


def test_dropping_a_cache_key_frees_its_entries_alone(page_server):
    """At the endpoint the page calls: the key's entries go (what the cache holds of its
    prompt falls to what another entry shares with it), another key's stay and are reused,
    and so does a `cache_salt` tenant's of the same key."""
    client, runner = page_server.openai(), page_server.runner
    salted = {"cache_salt": "tenant"}
    prompts = {
        text: [{"role": "user", "content": f"Conversation {text} says hi"}] for text in "ABC"
    }
    for key, text, extra in [("drop-me", "A", {}), ("keep-me", "B", {}), ("drop-me", "C", salted)]:
        body = {"prompt_cache_key": key, **extra}
        client.chat.completions.create(
            model="any", messages=prompts[text], max_tokens=4, extra_body=body
        )
    _wait_until_idle(runner)
    tokens = {text: runner.encode(prompt) for text, prompt in prompts.items()}
    salted_tokens = runner.encode(prompts["C"], cache_salt="tenant")
    held = {text: runner.cached_prefix_tokens(tokens[text]) for text in "AB"}
    assert held == {"A": len(tokens["A"]), "B": len(tokens["B"])}

    status, body = page_server.request("DELETE", "/v1/mlxkv/cache/drop-me")
    assert (status, body) == (200, {"cache_key": "drop-me", "dropped_entries": 1})
    assert "drop-me" not in _labels(runner)
    pairs = zip(tokens["A"], tokens["B"], strict=False)
    shared = next(i for i, (a, b) in enumerate(pairs) if a != b)
    assert runner.cached_prefix_tokens(tokens["A"]) == shared
    assert runner.cached_prefix_tokens(tokens["B"]) == len(tokens["B"])
    assert runner.cached_prefix_tokens(salted_tokens, "tenant") == len(salted_tokens)
    status, body = page_server.request("DELETE", "/v1/mlxkv/cache/nonesuch")
    assert (status, body) == (200, {"cache_key": "nonesuch", "dropped_entries": 0})


def _screenshots(page) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "chat-light.png"))
    page.emulate_media(color_scheme="dark")
    page.screenshot(path=str(ARTIFACTS / "chat-dark.png"))
    page.set_viewport_size({"width": 390, "height": 844})
    page.locator("#cache-panel").wait_for(state="hidden")  # closed at phone width
    page.locator("#sidebar").evaluate(  # the list has slid out of view
        "el => Promise.all(el.getAnimations().map(a => a.finished))"
    )
    assert page.locator("#messages").is_visible()
    page.screenshot(path=str(ARTIFACTS / "chat-narrow.png"))
    for name in ("chat-light", "chat-dark", "chat-narrow"):
        assert (ARTIFACTS / f"{name}.png").stat().st_size > 10_000


def test_at_phone_width_the_panel_and_the_list_get_out_of_the_way(page):
    """Loaded wide and narrowed, the cache panel covered the chat; the conversation list slid
    over it covered its own button, with nothing to close it."""
    assert page.locator("#cache-panel").is_visible()
    page.set_viewport_size({"width": 390, "height": 844})
    page.locator("#cache-panel").wait_for(state="hidden")
    assert page.locator("#toggle-cache").get_attribute("aria-expanded") == "false"
    page.click("#menu")
    assert page.evaluate("document.body.classList.contains('show-sidebar')")
    page.mouse.click(370, 400)  # beside the list, on the chat
    assert not page.evaluate("document.body.classList.contains('show-sidebar')")


def test_server_errors_are_shown_in_the_page(page):
    """A turn refused before its first token shows the alert alone, no empty bubble."""
    _set(page, "#temperature", "7")
    _send(page, "Hi")
    error = page.locator(".message.assistant [role=alert]")
    assert "temperature" in error.inner_text()
    assert page.locator("#send").is_visible()

    _set(page, "#temperature", "")
    _send(page, "word " * (MAX_CONTEXT + 100))
    assert "context" in page.locator(".message.assistant [role=alert]").last.inner_text()
    assert page.locator(".message.assistant").count() == 2
    assert page.locator(".message.assistant .bubble").count() == 0
    page.reload()  # as stored
    assert page.locator(".message.assistant [role=alert]").count() == 2
    assert page.locator(".message.assistant .bubble").count() == 0


def test_a_refused_turn_is_left_out_of_the_next_request(page, loaded_tiny):
    """A message the server refused (too long here) is not sent again: before, it stayed in
    the history, so every later message of the conversation was refused as too long."""
    _set(page, "#max-tokens", "8")
    _send(page, "word " * (MAX_CONTEXT + 100))
    assert "context" in page.locator(".message.assistant [role=alert]").inner_text()
    _send(page, "Hello there")
    reply = _current(page)["messages"][-1]
    assert "error" not in reply
    expected = _fresh(loaded_tiny).generate(
        [{"role": "user", "content": "Hello there"}], max_tokens=8
    )
    assert (reply["content"], reply["stats"]["prompt"]) == (expected.text, expected.prompt_tokens)


def test_a_turn_stopped_before_its_first_token_is_left_out_of_the_next_request(page):
    """Stopped before any text came, the turn was sent again with an empty assistant message
    (a turn the model never gave); it is left out whole, as a refused turn is."""
    held, sent = [], []

    def answer(route):
        if not held:
            held.append(route)  # never answered: the reply has not started when Stop is hit
            return
        sent.append(route.request.post_data_json)
        route.continue_()

    page.route("**/v1/chat/completions", answer)
    page.fill("#input", "Never answered")
    page.press("#input", "Enter")
    page.locator(".message.assistant.pending").wait_for()
    page.click("#stop")
    page.locator(".message.assistant .stopped").wait_for()
    _send(page, "Hello there")
    assert [m["content"] for m in sent[0]["messages"]] == ["Hello there"]


def test_an_error_after_some_text_keeps_the_text_above_the_alert(page):
    """A stream that fails after its first words (the server's error event) keeps them."""
    chunk = {"choices": [{"index": 0, "delta": {"content": "Partial words"}}]}
    failed = {"error": {"message": "the generation failed here", "type": "server_error"}}
    events = "".join(f"data: {json.dumps(event)}\n\n" for event in (chunk, failed))
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(
            status=200, headers={"Content-Type": "text/event-stream"}, body=events
        ),
    )
    _send(page, "Hi")
    reply = page.locator(".message.assistant")
    assert reply.locator(".bubble").inner_text() == "Partial words"
    assert reply.locator("[role=alert]").inner_text() == "the generation failed here"


def test_a_key_protected_server_asks_for_the_key(browser, loaded_tiny):
    with (
        serve(Runner(loaded_tiny("llama"), max_context=1024), api_key="sesame") as served,
        open_page(browser, served.url + "/") as page,  # the page itself needs no key
    ):
        _set(page, "#max-tokens", "8")
        _send(page, "Hi")
        assert "API key" in page.locator(".message.assistant .error").inner_text()
        _set(page, "#api-key", "sesame")
        _send(page, "Hi again")
        assert "stats" in _current(page)["messages"][-1]


def test_markdown_is_rendered_and_model_html_stays_text(page):
    rendered = page.evaluate(
        """async (text) => (await import('./static/markdown.js')).renderMarkdown(text)""",
        "# Title\n\nSome **bold**, *italic* and `x<y`.\n\n- one\n- two\n\n"
        "```python\nprint('<b>')\n```\n\n<script>alert(1)</script> <img src=x onerror=alert(2)>"
        "\n[ok](https://example.com) [bad](javascript:alert(3))",
    )
    assert "<h1>Title</h1>" in rendered
    assert "<strong>bold</strong>" in rendered and "<em>italic</em>" in rendered
    assert "<code>x&lt;y</code>" in rendered
    assert "<ul><li>one</li><li>two</li></ul>" in rendered
    assert '<code class="language-python">print(&#39;&lt;b&gt;&#39;)</code>' in rendered
    assert "<script" not in rendered and "<img" not in rendered
    assert '<a href="https://example.com"' in rendered
    assert "[bad](javascript:alert(3))" in rendered  # only http(s) links become links


def test_cache_endpoint_equals_cache_info(page_server):
    client = page_server.openai()
    client.chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": "Count the entries"}],
        max_tokens=8,
        extra_body={"prompt_cache_key": "chat-42"},
    )
    _wait_until_idle(page_server.runner)
    status, body = page_server.request("GET", "/v1/mlxkv/cache")
    assert status == 200
    info = page_server.runner.cache_info()
    expected = json.loads(json.dumps(info.__dict__, default=lambda e: e.__dict__))
    # the endpoint leaves out entries made with a cache_salt, and the flag that says so
    expected["entries"] = [
        {k: v for k, v in e.items() if k != "isolated"}
        for e in expected["entries"]
        if not e["isolated"]
    ]
    # Process-wide readings that move with any allocation are compared for presence only.
    for moving in ("active_bytes", "mlx_cache_bytes"):
        assert isinstance(body.pop(moving), int)
        expected.pop(moving)
    assert body.pop("model") == page_server.runner.loaded.path.name
    assert body.pop("max_context") == MAX_CONTEXT
    assert body == expected
    current = next(e for e in body["entries"] if e["current"])
    assert current["label"] == "chat-42"
    assert current["num_tokens"] > 0


def test_a_thinking_models_thinking_is_folded_above_its_answer(browser, tmp_path):
    script = ("<think>", "Hmm.", "</think>", "Paris")
    path = build_template_model(tmp_path / "thinker", script, THINKING_TEMPLATE)
    with (
        serve(Runner(load_model(path), max_context=512)) as served,
        open_page(browser, served.url + "/") as page,
    ):
        _set(page, "#max-tokens", "16")
        _send(page, "Capital of France?")
        reply = _current(page)["messages"][1]
        assert (reply["reasoning"], reply["content"]) == ("Hmm.", "Paris")
        thinking = page.locator(".message.assistant .thinking")
        assert thinking.locator(".thought").text_content() == "Hmm."
        assert thinking.get_attribute("open") is None  # folded once the answer came
        assert page.locator(".message.assistant .bubble").inner_text().endswith("Paris")


def test_a_cross_site_page_cannot_make_the_server_generate(browser, page_server, access_log):
    """A page on another site posts a "simple" request (text/plain, no preflight) with a JSON
    body: the browser sends it, the server reads JSON whatever the type, and only the Origin
    check stands between that page and a generation (the chat page, same origin, works above)."""
    context = browser.new_context()
    evil = context.new_page()
    evil.route("http://evil.example/", lambda route: route.fulfill(body="<p>evil</p>"))
    evil.goto("http://evil.example/")
    body = json.dumps({"model": "m", "prompt": "Hi", "options": {"num_predict": 2}})
    evil.evaluate(
        """([url, body]) => fetch(url, {method: "POST", mode: "no-cors", body,
        headers: {"Content-Type": "text/plain"}}).catch(() => null)""",
        [page_server.url + "/api/generate", body],
    )
    line = access_log(r"POST /api/generate \d+.*").string
    context.close()
    assert " 403 " in line and "evil.example" in line
