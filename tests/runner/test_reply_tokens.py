"""A reply sent back whose text encodes to other tokens than the model wrote (SmolLM2 wrote
"SmolLAM" as `S|m|ol|L|AM`, which encodes as `Sm|ol|L|AM`): the next turn's prompt takes the
ids the model generated, so the cache is reused through the whole reply, and the reply that
follows is what a Runner with no cache computes for those ids."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxkv import Runner
from mlxkv.models.loading import load_model
from mlxkv.runner.results import Completion
from mlxkv.runner.text.replies import MAX_REPLIES, ReplyTokens
from mlxkv.testing.factory import build_scripted_model
from tests.tolerances import logits_tolerance

# Each piece one token; the text, "SmolLAMSmolLAM", encodes as two "SmolLAM" tokens.
SCRIPT = ("Sm", "ol", "LAM", "SmolLAM")
ASK = [{"role": "user", "content": "Who are you?"}]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    return load_model(build_scripted_model(tmp_path_factory.mktemp("smol") / "model", SCRIPT))


def _next_turn(reply: str) -> list[dict]:
    return ASK + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And what do you do?"},
    ]


def test_a_reply_that_encodes_otherwise_is_reused_in_full(scripted):
    runner = Runner(scripted, max_context=512)
    first = runner.generate(ASK, max_tokens=20, temperature=0)
    held = runner.cache_tokens
    assert first.text == "SmolLAMSmolLAM"
    encoded = scripted.tokenizer.encode(first.text, add_special_tokens=False)
    assert encoded != first.tokens and len(encoded) == 2  # the case at hand
    second = runner.generate(_next_turn(first.text), max_tokens=4, temperature=0)
    assert second.cached_tokens == len(held)  # prompt, reply and its end, all reused
    assert runner.cache_tokens[: len(held)] == held


def test_an_edited_reply_renders_as_text(scripted):
    """A client that changed the reply gets its text encoded as any message's."""
    runner = Runner(scripted, max_context=512)
    first = runner.generate(ASK, max_tokens=20, temperature=0)
    edited = _next_turn(first.text + "!")
    second = runner.generate(edited, max_tokens=1, temperature=0)
    assert second.prompt_tokens == len(runner.encode(edited))


def test_another_salts_reply_is_not_taken(scripted):
    """One tenant's prompt never takes another's reply ids: its token count would tell."""
    runner = Runner(scripted, max_context=512)
    first = runner.generate(ASK, max_tokens=20, temperature=0, cache_salt="alice")
    messages = _next_turn(first.text)
    bob = runner.generate(messages, max_tokens=1, temperature=0, cache_salt="bob")
    assert bob.prompt_tokens == len(runner.encode(messages, cache_salt="bob"))
    plain = scripted.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert bob.prompt_tokens == len(plain)
    alice = runner.generate(messages, max_tokens=1, temperature=0, cache_salt="alice")
    assert alice.prompt_tokens == bob.prompt_tokens + len(first.tokens) - 2


def test_a_reply_sent_back_as_text_parts_is_reused_as_its_string(scripted):
    """OpenAI-style text parts are joined, as the server joins them: the reply sent back as
    parts takes the ids the model generated, and the prompt is the string form's."""
    runner = Runner(scripted, max_context=512)
    first = runner.generate(ASK, max_tokens=20, temperature=0)
    held = runner.cache_tokens
    messages = _next_turn(first.text)
    half = len(first.text) // 2
    messages[1] = {
        "role": "assistant",
        "content": [{"type": "text", "text": t} for t in (first.text[:half], first.text[half:])],
    }
    assert runner.encode(messages) == runner.encode(_next_turn(first.text))
    second = runner.generate(messages, max_tokens=4, temperature=0)
    assert second.cached_tokens == len(held)


def test_the_next_reply_is_what_a_runner_without_cache_computes(loaded_tiny):
    """The random model (its replies re-encode otherwise too): its log-probabilities after
    the reused reply are those of a fresh Runner given the same prompt ids."""
    runner = Runner(loaded_tiny("llama"), max_context=512)
    first = runner.generate(ASK, max_tokens=16, temperature=0)
    held = runner.cache_tokens
    assert loaded_tiny("llama").tokenizer.encode(first.text, add_special_tokens=False) != (
        first.tokens
    )
    options = {"max_tokens": 6, "temperature": 0, "logprobs": 0}
    chunks = list(runner.stream(_next_turn(first.text), **options))
    second = chunks[-1].completion
    assert second.cached_tokens == len(held)
    prompt = runner.cache_tokens[: second.prompt_tokens]
    fresh = list(Runner(loaded_tiny("llama"), max_context=512).stream(prompt, **options))
    assert [c.token for c in chunks] == [c.token for c in fresh]
    ours = [c.logprob.logprob for c in chunks if c.logprob is not None]
    reference = [c.logprob.logprob for c in fresh if c.logprob is not None]
    np.testing.assert_allclose(ours, reference, atol=logits_tolerance(mx.array(reference)))


def _completion(text: str, tokens: list[int], **fields) -> Completion:
    options = {"finish_reason": "stop", "prompt_tokens": 1, "cached_tokens": 0, **fields}
    return Completion(
        text=text, tokens=tokens, prompt_tps=0.0, generation_tokens=len(tokens),
        generation_tps=0.0, ttft=0.0, peak_memory=0, **options,
    )  # fmt: skip


def test_only_replies_whose_text_is_their_ids_are_remembered():
    replies = ReplyTokens()
    replies.remember(_completion("cut", [1, 2, 3], stop_string="END"), None)
    replies.remember(_completion("gone", [4], finish_reason="cancelled"), None)
    replies.remember(_completion("kept", [5, 6]), None)
    sent_back = [{"role": "assistant", "content": text} for text in ("cut", "gone", "kept")]
    assert replies.known_in(sent_back, None) == {"kept": [5, 6]}
    assert replies.known_in(sent_back, "salt") == {}


def test_the_newest_replies_are_kept():
    replies = ReplyTokens()
    for i in range(MAX_REPLIES + 1):
        replies.remember(_completion(f"reply {i}", [i]), None)
    sent_back = [{"role": "assistant", "content": f"reply {i}"} for i in (0, MAX_REPLIES)]
    assert replies.known_in(sent_back, None) == {f"reply {MAX_REPLIES}": [MAX_REPLIES]}
