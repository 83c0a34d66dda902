"""A chat whose replies are decoded with drafts (accepted and rejected, plain decoding in
between) keeps a cache that the next turn reuses exactly as plain decoding's, and answers
what a fresh runner answers, log-probabilities included, on every architecture."""

from __future__ import annotations

import pytest

from mlxkv import Runner
from mlxkv.cache.prefix import common_prefix_length
from mlxkv.decoding.drafts import Draft
from mlxkv.models.loading import load_model
from mlxkv.runner import request_run
from mlxkv.testing.factory import ARCHITECTURES, build_scripted_model

TURNS = 4
REPLY_TOKENS = 24
QUESTIONS = [
    "What do caches hold?",
    "And how much memory does that take, per token?",
    "Say it again, shorter.",
    "Thank you. One more detail?",
]


class _IntermittentDrafter:
    """Drafts the reference reply's next four tokens at every fifth reply position, the third
    of them wrong: two accepted and a rejection rolled back each time, and plain decoding in
    between (its ids still lazy when the next verification feeds a draft)."""

    def __init__(self, prompt, reply):
        self._start = len(prompt)
        self._text = list(prompt)
        self._whole = list(prompt) + list(reply)

    def extend(self, tokens):
        self._text.extend(tokens)

    def can_propose(self):
        at = len(self._text)
        return (at - self._start) % 5 in (1, 2) and at < len(self._whole)

    def propose(self, limit):
        if not self.can_propose():
            return Draft([])
        truth = self._whole[len(self._text) : len(self._text) + min(limit, 4)]
        return Draft([t + 1 if i == 2 else t for i, t in enumerate(truth)])


def _close_logprobs(got, want, tolerance: float = 1e-3) -> bool:
    return all(abs(a.logprob - b.logprob) <= tolerance for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_drafted_replies_keep_the_next_turns_reuse_and_answers(loaded_tiny, arch, monkeypatch):
    loaded = loaded_tiny(arch)
    drafted = Runner(loaded, max_context=2048)
    plain = Runner(loaded, max_context=2048, speculative=None)
    messages = [{"role": "system", "content": "You are brief."}]
    drafted_turns, previous_prompt = 0, 0
    for turn, question in enumerate(QUESTIONS[:TURNS]):
        messages.append({"role": "user", "content": question})
        options = {"max_tokens": REPLY_TOKENS, "logprobs": 2}
        fresh = Runner(loaded, max_context=2048, speculative=None)
        reference_chunks = list(fresh.stream(messages, **options))
        reference = reference_chunks[-1].completion
        reply = [*reference.tokens, *loaded.tokenizer.eos_token_ids][: REPLY_TOKENS + 1]
        monkeypatch.setattr(
            request_run,
            "NgramDrafter",
            lambda prompt, vocab_size, reply=reply: _IntermittentDrafter(prompt, reply),
        )
        chunks = list(drafted.stream(messages, speculative="ngram", **options))
        out = chunks[-1].completion
        same_turn = plain.generate(messages, **options)
        assert out.tokens == reference.tokens, f"turn {turn}: the answer differs"
        assert _close_logprobs(
            [c.logprob for c in chunks[:-1]], [c.logprob for c in reference_chunks[:-1]]
        ), f"turn {turn}: log-probabilities differ from a fresh runner's"
        if len(reference.tokens) > 6:  # long enough for a verification with a rejection
            assert out.drafted_tokens > out.accepted_tokens > 0, f"turn {turn}: no drafting"
            drafted_turns += 1
        assert out.cached_tokens == same_turn.cached_tokens, f"turn {turn}: reuse differs"
        if turn:  # at least the previous prompt up to its reply (a checkpoint where needed)
            assert out.cached_tokens >= previous_prompt - _generation_prompt_tokens(plain, messages)
        previous_prompt = out.prompt_tokens
        messages.append({"role": "assistant", "content": out.text})
    assert drafted_turns >= TURNS // 2


def _generation_prompt_tokens(runner, messages) -> int:
    """Tokens the chat template adds to open the assistant's turn."""
    with_prompt = runner.encode(messages)
    without = runner._prompts.chat.render(messages, add_generation_prompt=False)
    return len(with_prompt) - common_prefix_length(with_prompt, without)


def test_a_reply_that_quotes_the_prompt_is_reused_whole_next_turn(tmp_path):
    """The natural case: n-gram drafts found in the prompt, turn after turn."""
    recited = tuple(f"w{i:02d}" for i in range(24))
    loaded = load_model(build_scripted_model(tmp_path / "m", recited))
    runner = Runner(loaded, max_context=2048)
    messages = [{"role": "user", "content": "Say it back: " + "".join(recited)}]
    reused = []
    for _ in range(3):
        out = runner.generate(messages, max_tokens=40, speculative="ngram")
        assert out.text == "".join(recited) and out.accepted_tokens >= 12
        reused.append(out.cached_tokens - out.prompt_tokens)
        messages += [
            {"role": "assistant", "content": out.text},
            {"role": "user", "content": "Again: " + "".join(recited)},
        ]
    # Each turn after the first reuses all but its new user message and the template's markers.
    new_message = len(runner.encode([{"role": "user", "content": "Again: " + "".join(recited)}]))
    assert all(-new_message - 4 <= r for r in reused[1:]), reused
