"""A reply whose text encodes to other tokens than the model wrote, sent back by the real
clients: the next turn reuses the previous prompt and the whole reply."""

from __future__ import annotations

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
