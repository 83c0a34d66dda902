"""The default model's tokenizer (a digit-splitting byte-level BPE) tokenizes the recorded agent
sessions, rendered with its own chat template, a segment at a time exactly as whole."""

import pytest

from mlxkv.models.loading import load_model
from mlxkv.runner.text.chat import ChatTemplate
from mlxkv.runner.text.segments import SegmentEncoder
from tests.runner.test_prompt_segments import SESSIONS, _turns, _whole, _WholeText


@pytest.fixture(scope="module")
def tokenizer(converted_cache):
    return load_model(None).tokenizer


def test_the_default_tokenizer_is_cut_into_segments(tokenizer):
    assert SegmentEncoder(tokenizer)._backend is not None  # else the test below proves nothing


@pytest.mark.parametrize("session", SESSIONS)
def test_recorded_turns_tokenize_as_their_whole_text(tokenizer, session):
    vocab = len(tokenizer.get_vocab())
    encoder, reference = ChatTemplate(tokenizer, vocab), ChatTemplate(tokenizer, vocab)
    reference._segments = _WholeText(tokenizer)
    reference._plain_ids = lambda text: reference.controls.plain.encode(text).ids
    for messages, tools in _turns(session):
        assert encoder.render(messages, tools=tools) == reference.render(messages, tools=tools)
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
        assert encoder._segments.encode(text) == _whole(tokenizer, text)
