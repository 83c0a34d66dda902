"""Retry and edit on the chat page (a real headless Chromium, as in test_chat_page.py): Retry
sends the last prompt again in place of its reply, Edit changes a message the user wrote and
drops the turns after it. Each new reply, and the tokens the server took from its cache, are
checked against a fresh Runner that was sent the same requests."""

from __future__ import annotations

from .chat_page import _current, _fresh, _send, _set

USER = "user"
MAX_TOKENS = 12


def _sent_messages(page, action) -> list[dict]:
    """Runs `action` (a click, a key) that sends a chat request, waits until its reply has
    been shown whole, and returns the messages the request sent."""
    with page.expect_response("**/v1/chat/completions") as response:
        action()
    response.value.finished()
    page.locator("#send").wait_for(state="visible")  # the page has read the whole reply
    return response.value.request.post_data_json["messages"]


def _user(text: str) -> list[dict]:
    return [{"role": USER, "content": text}]


def test_retry_sends_the_same_prompt_and_takes_it_from_the_cache(page, loaded_tiny):
    _set(page, "#max-tokens", str(MAX_TOKENS))
    _send(page, "Hello there")
    sent = _sent_messages(page, lambda: page.click(".message.assistant .retry"))
    assert sent == _user("Hello there")
    chat = _current(page)
    assert [m["role"] for m in chat["messages"]] == [USER, "assistant"]  # in place of the old

    reference = _fresh(loaded_tiny)
    reference.generate(sent, max_tokens=MAX_TOKENS)
    again = reference.generate(sent, max_tokens=MAX_TOKENS)
    reply = chat["messages"][1]
    assert reply["content"] == again.text
    assert reply["stats"]["cached"] == again.cached_tokens == again.prompt_tokens - 1


def test_edit_drops_the_turns_after_the_message_and_reuses_the_cache_before_it(page, loaded_tiny):
    _set(page, "#max-tokens", str(MAX_TOKENS))
    _send(page, "What is a cache?")
    _send(page, "And a prefix?")
    page.locator(".message.user .edit").first.click()
    page.fill(".edit-input", "What is a prompt cache?")
    sent = _sent_messages(page, lambda: page.press(".edit-input", "Enter"))
    assert sent == _user("What is a prompt cache?")
    chat = _current(page)
    assert [m["role"] for m in chat["messages"]] == [USER, "assistant"]
    assert chat["title"] == "What is a prompt cache?"  # named after its first message

    reference = _fresh(loaded_tiny)
    reference.generate(_user("What is a cache?"), max_tokens=MAX_TOKENS)
    edited = reference.generate(sent, max_tokens=MAX_TOKENS)
    reply = chat["messages"][1]
    assert reply["content"] == edited.text
    assert 0 < reply["stats"]["cached"] == edited.cached_tokens < edited.prompt_tokens


def test_escape_leaves_the_message_as_it_was_and_sends_nothing(page):
    _set(page, "#max-tokens", str(MAX_TOKENS))
    _send(page, "Keep this")
    before = _current(page)
    requests = []
    page.on("request", lambda request: requests.append(request.url))
    page.locator(".message.user .edit").click()
    page.fill(".edit-input", "Not this")
    page.press(".edit-input", "Escape")
    assert page.locator(".edit-input").count() == 0
    assert page.locator(".message.user .bubble").inner_text() == "Keep this"
    assert _current(page) == before
    assert not [url for url in requests if url.endswith("/v1/chat/completions")]


def test_a_half_typed_edit_outlives_opening_another_conversation(page):
    _set(page, "#max-tokens", str(MAX_TOKENS))
    _send(page, "First chat")
    first = page.locator("#conversations li.selected").get_attribute("data-id")
    page.locator(".message.user .edit").click()
    page.fill(".edit-input", "Half typed")
    page.click("#new-chat")
    assert page.locator(".edit-input").count() == 0
    page.locator(f"#conversations li[data-id='{first}'] .open").click()
    assert page.locator(".edit-input").input_value() == "Half typed"


def test_the_buttons_are_hidden_while_a_reply_is_generated(page):
    """Retry or Edit during a reply would change the conversation under it."""
    _set(page, "#max-tokens", str(MAX_TOKENS))
    _send(page, "First")
    held = []
    page.route("**/v1/chat/completions", lambda route: held.append(route))
    page.fill("#input", "Second")
    page.press("#input", "Enter")
    page.locator(".message.assistant.pending").wait_for()
    assert page.locator(".message .actions button").count() == 0
    page.click("#stop")
    page.locator(".message.assistant .stopped").wait_for()
    assert page.locator(".message.user .edit").count() == 2
    assert page.locator(".message.assistant .retry").count() == 1  # on the last reply alone


def test_retry_after_a_refused_turn_sends_it_with_the_settings_fixed(page, loaded_tiny):
    _set(page, "#max-tokens", str(MAX_TOKENS))
    _set(page, "#temperature", "7")
    _send(page, "Hello there")
    assert "temperature" in page.locator(".message.assistant [role=alert]").inner_text()
    _set(page, "#temperature", "")
    sent = _sent_messages(page, lambda: page.click(".message.assistant .retry"))
    assert sent == _user("Hello there")
    reply = _current(page)["messages"][1]
    assert "error" not in reply
    expected = _fresh(loaded_tiny).generate(sent, max_tokens=MAX_TOKENS)
    assert reply["content"] == expected.text
