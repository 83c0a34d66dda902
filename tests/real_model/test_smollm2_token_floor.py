"""The default model's tokenizer (a digit-splitting byte-level BPE) has a floor
(`TokenFloor`), and the recorded agent sessions, rendered with its chat template, take
at least it; a message far over the window is refused untokenized, counted no higher."""

import pytest

from mlxkv import ContextLengthError, Runner
from mlxkv.models.loading import load_model
from mlxkv.runner.text.tokenizer_facts import TokenFloor
from tests.runner.test_prompt_segments import SESSIONS, _turns


@pytest.fixture(scope="module")
def loaded(converted_cache):
    return load_model(None)


@pytest.mark.parametrize("session", SESSIONS)
def test_recorded_turns_take_at_least_their_floor(loaded, session):
    tokenizer = loaded.tokenizer
    floor = TokenFloor(tokenizer)
    assert floor.longest_bytes is not None  # else the test proves nothing
    for messages, tools in _turns(session):
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
        takes = len(tokenizer.encode(text, add_special_tokens=False))
        assert 0 < floor.tokens_at_least(text) <= takes


def test_a_message_far_over_the_window_is_refused_untokenized(loaded, monkeypatch):
    runner = Runner(loaded, max_context=512, warmup=False)
    messages = [{"role": "user", "content": "The capital of France is Paris. " * 20_000}]
    segments = runner._prompts.chat._segments
    monkeypatch.setattr(segments, "encode", lambda text: pytest.fail("tokenized"))
    with pytest.raises(ContextLengthError, match="the prompt is at least") as refused:
        runner.generate(messages, max_tokens=1, truncate=False)
    monkeypatch.undo()
    assert 2 * 512 <= refused.value.prompt_tokens <= len(runner.encode(messages))
