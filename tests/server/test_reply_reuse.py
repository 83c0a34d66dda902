"""A reply whose text encodes to other tokens than the model wrote, sent back by the real
clients: the next turn reuses the previous prompt and the whole reply."""

from __future__ import annotations

import ollama
import pytest

from mlxkv import Runner
from mlxkv.models.loading import load_model
from mlxkv.testing.factory import build_scripted_model
from tests.runner.test_reply_tokens import ASK, SCRIPT
from tests.server.conftest import serve


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = build_scripted_model(tmp_path_factory.mktemp("smol") / "model", SCRIPT)
    with serve(Runner(load_model(path), max_context=512)) as s:
        yield s


def test_openai_second_turn_reuses_the_whole_reply(served):
    client = served.openai()
    first = client.chat.completions.create(model="m", messages=ASK, max_tokens=20)
    reply = first.choices[0].message.content
    tokenizer = served.runner.tokenizer
    assert len(tokenizer.encode(reply, add_special_tokens=False)) < first.usage.completion_tokens
    held = len(served.runner.cache_tokens)
    messages = [*ASK, {"role": "assistant", "content": reply}, {"role": "user", "content": "Go"}]
    second = client.chat.completions.create(model="m", messages=messages, max_tokens=2)
    assert second.usage.prompt_tokens_details.cached_tokens == held


def test_anthropic_streamed_second_turn_reuses_the_whole_reply(served):
    client = served.anthropic()
    with client.messages.stream(model="m", messages=ASK, max_tokens=20) as stream:
        reply = stream.get_final_message().content[0].text
    held = len(served.runner.cache_tokens)
    messages = [*ASK, {"role": "assistant", "content": reply}, {"role": "user", "content": "Go"}]
    second = client.messages.create(model="m", messages=messages, max_tokens=2)
    assert second.usage.cache_read_input_tokens == held


def _salted_second_turn(served, salt: str) -> list[dict]:
    """A first turn in `salt`'s domain, and the second turn's messages with its reply sent
    back (the module's other tests may have generated the same reply without a salt)."""
    client = served.anthropic()
    extra = {"cache_salt": salt}
    first = client.messages.create(model="m", messages=ASK, max_tokens=20, extra_body=extra)
    reply = first.content[0].text
    return [*ASK, {"role": "assistant", "content": reply}, {"role": "user", "content": "Go"}]


def test_anthropic_count_tokens_counts_the_reply_as_generated_in_its_salt(served):
    messages = _salted_second_turn(served, "count")
    client = served.anthropic()

    def count(salt):
        extra = {"cache_salt": salt}
        return client.messages.count_tokens(model="m", messages=messages, extra_body=extra)

    salted = {"cache_salt": "count"}
    second = client.messages.create(model="m", messages=messages, max_tokens=2, extra_body=salted)
    usage = second.usage
    total = usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
    assert count("count").input_tokens == total
    assert count("another").input_tokens < total  # there, the reply is only text


def test_anthropic_diagnostics_see_the_reply_as_generated_in_its_salt(served):
    messages = _salted_second_turn(served, "diagnose")
    client = served.anthropic()

    def ask(previous):
        extra = {"cache_salt": "diagnose", "diagnostics": {"previous_message_id": previous}}
        return client.messages.create(model="m", messages=messages, max_tokens=2, extra_body=extra)

    second = ask(None)
    assert ask(second.id).diagnostics is None  # the same prompt again: nothing missed


def test_after_a_restart_every_api_renders_the_reply_as_generated(tmp_path_factory, tmp_path):
    """A server restarted on the same disk tier (a model loaded afresh: its reply memory is
    what the disk kept) counts, caches and answers the reply sent back as the ids it
    generated, through every API's prompt encode: OpenAI's cached tokens, Anthropic's
    count_tokens and cache reads, Ollama's prompt count."""
    path = build_scripted_model(tmp_path_factory.mktemp("smol") / "model", SCRIPT)
    before = Runner(load_model(path), max_context=512, cache_dir=tmp_path)
    with serve(before) as s:
        first = s.openai().chat.completions.create(model="m", messages=ASK, max_tokens=20)
        held = len(before.cache_tokens)
    before.close()
    reply = first.choices[0].message.content
    messages = [*ASK, {"role": "assistant", "content": reply}, {"role": "user", "content": "Go"}]
    want = before.encode(messages)  # as the process that generated the reply renders it
    restarted = Runner(load_model(path), max_context=512, cache_dir=tmp_path, cache_entries=4)
    with serve(restarted) as s:
        assert s.anthropic().messages.count_tokens(model="m", messages=messages).input_tokens == (
            len(want)
        )
        second = s.openai().chat.completions.create(model="m", messages=messages, max_tokens=2)
        assert second.usage.prompt_tokens == len(want)
        assert second.usage.prompt_tokens_details.cached_tokens == held  # loaded from disk
        third = s.anthropic().messages.create(model="m", messages=messages, max_tokens=2)
        assert third.usage.cache_read_input_tokens == len(want) - 1  # all but the last
        ollama_reply = ollama.Client(host=s.url).chat(
            model="m", messages=messages, options={"num_predict": 2}
        )
        assert ollama_reply.prompt_eval_count == len(want)
