"""Rendered prompts tokenized a segment at a time (`text.segments`), the segments of earlier
turns taking their kept ids: always the ids of the whole text tokenized at once."""

import json
import random
from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from mlxkv.runner.text.chat import ChatTemplate
from mlxkv.runner.text.segments import KeptIds, SegmentEncoder
from mlxkv.server.anthropic_api.protocol import MessagesRequest
from mlxkv.server.responses_api.protocol import ResponsesRequest, chat_messages
from mlxkv.testing.factory import build_model

FIXTURES = Path(__file__).parents[2] / "benchmarks" / "fixtures"
SESSIONS = ("claude_code_session", "codex_session")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(build_model("llama", tmp_path_factory.mktemp("segments") / "llama"))


def _turns(session: str) -> list[tuple[list[dict], list[dict] | None]]:
    """Each recorded request's chat messages and tools (mlxkv's own converters)."""
    turns = []
    for line in (FIXTURES / f"{session}.jsonl").read_text().splitlines():
        body = json.loads(line)
        if "input" in body:
            request = ResponsesRequest.model_validate(body)
            messages = chat_messages(request.instructions, request.input_items())
        else:
            request = MessagesRequest.model_validate(body)
            messages = request.chat_messages()
        turns.append((messages, request.template_tools()))
    return turns


def _whole(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


class _WholeText:
    """The reference: each text tokenized at once, nothing kept."""

    def __init__(self, tokenizer):
        self.encode = lambda text: _whole(tokenizer, text)


@pytest.mark.parametrize("session", SESSIONS)
def test_each_recorded_turn_renders_to_the_ids_of_its_whole_text(tokenizer, session):
    encoder, reference = ChatTemplate(tokenizer, 512), ChatTemplate(tokenizer, 512)
    reference._segments = _WholeText(tokenizer)
    reference._plain_ids = lambda text: reference.controls.plain.encode(text).ids  # content as text
    for messages, tools in _turns(session):  # in order: later turns reuse earlier segments
        for gen in (True, False):
            expected = reference.render(messages, tools=tools, add_generation_prompt=gen)
            got = encoder.render(messages, tools=tools, add_generation_prompt=gen)
            assert got == expected
        assert encoder.render(messages[:1]) == reference.render(messages[:1])


@pytest.mark.parametrize("seed", range(4))
def test_random_edits_of_a_recorded_prompt_tokenize_as_the_whole_text(tokenizer, seed):
    """Edits at random places (inside a segment, across control tokens, whitespace before one,
    a control token cut in half) on a text whose segments are all kept already."""
    rng = random.Random(seed)
    messages, tools = _turns("codex_session")[-1]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    segments = SegmentEncoder(tokenizer)
    assert segments.encode(text) == _whole(tokenizer, text)
    pieces = ["<|im_start|>", "<|im_end|>", "<|im_", " ", "  \n", "\n\n", "é", "x", "1234"]
    for _ in range(40):
        at = rng.randrange(len(text) + 1)
        if rng.random() < 0.5:
            text = text[:at] + rng.choice(pieces) + text[at:]
        else:
            text = text[:at] + text[at + rng.randrange(1, 40) :]
        assert segments.encode(text) == _whole(tokenizer, text)


def test_a_kept_segment_is_not_changed_by_the_caller(tokenizer):
    segments = SegmentEncoder(tokenizer)
    first = segments.encode("<|im_start|>user\nhello<|im_end|>")
    first.append(0)
    assert segments.encode("<|im_start|>user\nhello<|im_end|>") == first[:-1]


def test_a_full_cache_keeps_the_latest_segments_and_stays_exact(tokenizer):
    segments = SegmentEncoder(tokenizer, max_kept_chars=60)
    texts = [f"<|im_start|>user\nturn {i}<|im_end|>\n" for i in range(5)]
    for _ in range(2):
        assert segments.encode("".join(texts)) == _whole(tokenizer, "".join(texts))


def _edited(tokenizer, change) -> PreTrainedTokenizerFast:
    described = json.loads(tokenizer.backend_tokenizer.to_str())
    change(described)
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(described)))


def _strip_left(described):
    for token in described["added_tokens"]:
        token["lstrip"] = True


def _prefix_first(described):
    described["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False},
            described["pre_tokenizer"],
        ],
    }


def _truncating(described):  # the Python tokenizer turns it off around its own encode
    described["truncation"] = {
        "direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0
    }  # fmt: skip


@pytest.mark.parametrize(
    "change", [_strip_left, _prefix_first, _truncating], ids=["lstrip", "metaspace", "truncation"]
)
def test_a_tokenizer_that_reaches_across_cuts_is_tokenized_whole(tokenizer, change):
    edited = _edited(tokenizer, change)
    segments = SegmentEncoder(edited)
    text = "a  <|im_start|>user\n  hi  <|im_end|>\n<|im_start|>assistant\n"
    for _ in range(2):
        assert segments.encode(text) == _whole(edited, text)


def test_kept_ids_are_those_encoded_and_the_oldest_go_first():
    calls = []

    def encode(text):
        calls.append(text)
        return [len(text)]

    kept = KeptIds(encode, max_kept_chars=5)
    assert [kept("a"), kept("bb"), kept("a"), kept("ccc"), kept("bb")] == [[1], [2], [1], [3], [2]]
    # 6 characters over 5 when "ccc" came: "bb", the least recently used, was dropped
    assert calls == ["a", "bb", "ccc", "bb"]
    assert kept("ccc") == [3]  # kept: "ccc" and "bb" (5 characters)
    assert calls == ["a", "bb", "ccc", "bb"]
    kept("a")  # dropped when "bb" came back
    assert calls[-1] == "a"
