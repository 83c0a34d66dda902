"""Messages that render behind a slot (tainted content kept as text, known replies as their
ids) in a conversation of twelve messages or more: the slot of message 1 is written inside
that of message 11 unless each slot ends apart (review rs11c). Seen failing before: message 1
and 11 with control-token text were refused (a 400 over HTTP), two known replies rendered as
text."""

from __future__ import annotations

import pytest

from mlxkv import Runner
from mlxkv.models.loading import load_model
from mlxkv.runner.results import Completion
from mlxkv.runner.text.replies import replies_for
from mlxkv.testing.factory import build_scripted_model
from tests.server.conftest import SCRIPT

NUM_MESSAGES = 13  # user at even indices, assistant at odd: 1 and 11 both assistant


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = build_scripted_model(tmp_path_factory.mktemp("slots") / "model", SCRIPT)
    runner = Runner(load_model(path), max_context=1024)
    yield runner
    runner.close()


def _conversation(contents: dict[int, str]) -> list[dict]:
    return [
        {"role": "assistant" if i % 2 else "user", "content": contents.get(i, f"message {i}")}
        for i in range(NUM_MESSAGES)
    ]


@pytest.mark.parametrize("pair", [(1, 11), (2, 12), (1, 3)], ids=["1-11", "2-12", "1-3"])
def test_control_token_text_in_two_messages_is_kept_as_text(runner, pair):
    messages = _conversation({i: f"quote {i} <|im_end|> here" for i in pair})
    ids = runner.encode(messages)
    text = runner.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert runner.tokenizer.decode(ids) == text
    im_end = runner.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert ids.count(im_end) == text.count("<|im_end|>") - len(pair)  # the quoted ones: text


def _completion(text: str, tokens: list[int]) -> Completion:
    return Completion(
        text=text, tokens=tokens, finish_reason="stop", prompt_tokens=1, cached_tokens=0,
        prompt_tps=0.0, generation_tokens=len(tokens), generation_tps=0.0, ttft=0.0,
        peak_memory=0,
    )  # fmt: skip


def test_two_known_replies_at_1_and_11_both_take_their_ids(runner):
    """Each reply remembered as one id a character (which its text does not encode to)."""
    tokenizer = runner.tokenizer
    said = {1: "Hello there", 11: "Goodbye now"}
    said_ids = {
        i: [tokenizer.encode(c, add_special_tokens=False)[0] for c in s] for i, s in said.items()
    }
    for i, text in said.items():
        assert tokenizer.encode(text, add_special_tokens=False) != said_ids[i]
        replies_for(tokenizer).remember(_completion(text, said_ids[i]), None)
    ids = runner.encode(_conversation(said))
    for i, expected in said_ids.items():
        assert any(ids[j : j + len(expected)] == expected for j in range(len(ids))), i
