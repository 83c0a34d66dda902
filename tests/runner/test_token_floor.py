"""The fewest tokens a text can take, known from its length (`TokenFloor`): never more
than the tokens it takes, on texts built to come close (the longest token repeated) and to
shrink under a normal form, and no floor for a tokenizer where a token may stand for a run of
unknown text or a step may take text away."""

import json

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from mlxkv.runner.text.tokenizer_facts import TokenFloor
from mlxkv.testing.factory import build_model
from tests.runner.test_prompt_segments import SESSIONS, _turns

JAMO = "\u1100\u1161\u11a8"  # a Hangul syllable's three jamo: 9 bytes, 3 once composed (NFC)
TEXTS = {
    "ascii": "The quick brown fox jumps over the lazy dog. " * 50,
    "spaces": " " * 5000,
    "digits": "0123456789" * 300,
    "jamo": JAMO * 1000,
    "combining": "e\u0301" * 2000,
    "emoji": "\U0001f600\u200d\U0001f525" * 500,
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(build_model("llama", tmp_path_factory.mktemp("floor") / "llama"))


def _described(tokenizer) -> dict:
    return json.loads(tokenizer.backend_tokenizer.to_str())


def _with(described: dict, **steps) -> PreTrainedTokenizerFast:
    """The tokenizer `described`, with its normalizer, pre-tokenizer or model fields replaced."""
    described = {**described, **steps}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(described)))


def _takes(tokenizer, text: str) -> int:
    return len(tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids)


def _longest_token_text(tokenizer) -> str:
    vocab = tokenizer.backend_tokenizer.get_vocab()
    longest = max(vocab, key=lambda token: len(token.encode()))
    return tokenizer.decode([vocab[longest]])


def _assert_floor_holds(tokenizer, texts) -> None:
    floor = TokenFloor(tokenizer)
    assert floor.longest_bytes is not None, "no floor: the test below proves nothing"
    for name, text in texts.items():
        at_least, takes = floor.tokens_at_least(text), _takes(tokenizer, text)
        assert 0 < at_least <= takes, f"{name}: floor {at_least} over the {takes} it takes"


def test_the_floor_never_passes_the_tokens_a_text_takes(tokenizer):
    near = _longest_token_text(tokenizer) * 200  # as few tokens as the floor allows
    _assert_floor_holds(tokenizer, {**TEXTS, "longest token": near})
    floor = TokenFloor(tokenizer)
    assert floor.tokens_at_least(near) * 2 > _takes(tokenizer, near)  # a close floor there


@pytest.mark.parametrize("session", SESSIONS)
def test_rendered_agent_sessions_take_at_least_their_floor(tokenizer, session):
    texts = {
        f"turn {i}": tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
        for i, (messages, tools) in enumerate(_turns(session))
    }
    _assert_floor_holds(tokenizer, texts)


@pytest.mark.parametrize("form", ["NFC", "NFKC"])
def test_a_normal_form_that_shrinks_the_text_is_applied_first(tokenizer, form):
    normalized = _with(_described(tokenizer), normalizer={"type": form})
    _assert_floor_holds(normalized, TEXTS)
    # composed, the jamo take a third of the bytes: a floor from the raw bytes would pass it
    raw = TokenFloor(normalized).longest_bytes
    assert len(TEXTS["jamo"].encode()) / raw > TokenFloor(normalized).tokens_at_least(TEXTS["jamo"])


@pytest.mark.parametrize(
    "steps",
    [
        {"normalizer": {"type": "Lowercase"}},  # the Kelvin sign's 3 bytes become "k"'s one
        {"normalizer": {"type": "Strip", "strip_left": True, "strip_right": True}},
        {"pre_tokenizer": {"type": "Whitespace"}},  # drops the spaces
        {
            "pre_tokenizer": {
                "type": "Split",
                "pattern": {"String": " "},
                "behavior": "Removed",
                "invert": False,
            }
        },
        "unknown token",
        "stripping added token",
    ],
    ids=["lowercase", "strip", "whitespace", "split-removed", "unknown-token", "added-lstrip"],
)
def test_no_floor_where_text_may_go_untokenized(tokenizer, steps):
    described = _described(tokenizer)
    if "pre_tokenizer" in steps:  # before the byte-level step, which stays
        steps = {
            "pre_tokenizer": {
                "type": "Sequence",
                "pretokenizers": [steps["pre_tokenizer"], described["pre_tokenizer"]],
            }
        }
    elif steps == "unknown token":  # a BPE whose unknown token stands for a run of text
        model = {**described["model"], "unk_token": "<|endoftext|>"}
        metaspace = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always"}
        steps = {"pre_tokenizer": {**metaspace, "split": True}, "model": model}
    elif steps == "stripping added token":  # Phi-3's `<|end|>` takes the spaces after it
        added = [{**t, "lstrip": True} for t in described["added_tokens"]]
        spaced = _with(described, added_tokens=added)
        assert _takes(spaced, "hi" + " " * 3000 + "<|im_end|>") < 5  # 3,000 spaces in one
        steps = {"added_tokens": added}
    assert TokenFloor(_with(described, **steps)).longest_bytes is None


def test_bytes_that_no_token_stands_for_are_not_counted(tokenizer):
    """A byte-level vocabulary without a byte's character drops that byte (the default
    model's GGUF lacks 21, control characters among them): a text of it takes no token."""
    described = _described(tokenizer)
    vocab = {t: i for t, i in described["model"]["vocab"].items() if t != "Ĕ"}  # 0x14
    merges = [m for m in described["model"]["merges"] if "Ĕ" not in str(m)]
    lacking = _with(described, model={**described["model"], "vocab": vocab, "merges": merges})
    _assert_floor_holds(lacking, {**TEXTS, "0x14 among": "ab\x14" * 1000})
    assert TokenFloor(lacking).tokens_at_least("\x14" * 1000) == _takes(lacking, "\x14" * 1000) == 0


def test_a_tokenizer_without_a_tokenizers_backend_has_no_floor():
    assert TokenFloor(object()).longest_bytes is None
