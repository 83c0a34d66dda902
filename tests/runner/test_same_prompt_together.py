"""Two requests with one prompt at once (two clients, or one sampling twice): the second
copies the first's entry while it decodes. Both replies go back to their clients, so each
conversation's next turn must reuse what it would with the Runner to itself; unlike the
chat page's Stop then send (`test_stop_then_send.py`), the copy took none of the first's
reply, so the first's entry is not the same conversation going on."""

from __future__ import annotations

import threading

import pytest

from mlxkv import Runner
from tests.factories import joined
from tests.tolerances import LOGPROB_ABS, logprob_rel

QUESTION = [{"role": "user", "content": "Once upon a time there was"}]
OPTIONS = {"temperature": 0.0, "logprobs": 0}
SETTINGS = {"max_context": 512, "cache_entries": 4, "max_batch": 4, "speculative": None}
# Greedy: the replies differ by length alone (A goes on past B), which is enough for B's
# entry alone to miss what turn 2 of A sends back.
LONG_TOKENS, SHORT_TOKENS = 16, 4


def _turn_two(reply: str) -> list[dict]:
    return [
        *QUESTION,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "Go on."},
    ]


def _run(runner: Runner, messages: list[dict], max_tokens: int) -> tuple[object, list[float]]:
    """The completion and its tokens' log-probabilities."""
    chunks = list(runner.stream(messages, max_tokens=max_tokens, **OPTIONS))
    return chunks[-1].completion, [c.logprob.logprob for c in chunks if c.logprob is not None]


def _alone(loaded, max_tokens: int):
    """Turn 1 then turn 2 on a fresh Runner, no other request: the reference."""
    runner = Runner(loaded, **SETTINGS)
    first = runner.generate(QUESTION, max_tokens=max_tokens, **OPTIONS)
    return first, runner.generate(_turn_two(first.text), max_tokens=8, **OPTIONS)


def test_two_requests_with_one_prompt_at_once_keep_both_replies(loaded_tiny):
    loaded = loaded_tiny("llama")
    runner = Runner(loaded, **SETTINGS)
    first = runner.stream(QUESTION, batched=True, max_tokens=LONG_TOKENS, **OPTIONS)
    chunks = [next(first)]  # its entry claimed, its reply decoding
    got: list = []
    second = threading.Thread(
        target=lambda: got.append(
            list(runner.stream(QUESTION, batched=True, max_tokens=SHORT_TOKENS, **OPTIONS))
        )
    )
    second.start()
    joined(second)
    chunks += list(first)  # ends after the second: the second's copy is released first
    reply_a, reply_b = chunks[-1].completion, got[0][-1].completion
    assert reply_b.cached_tokens == reply_b.prompt_tokens - 1  # it copied the first's entry
    for turn_one, max_tokens in ((reply_a, LONG_TOKENS), (reply_b, SHORT_TOKENS)):
        want_one, want = _alone(loaded, max_tokens)
        assert turn_one.tokens == want_one.tokens
        two, logprobs = _run(runner, _turn_two(turn_one.text), 8)
        # before: A's entry was dropped (20 of A's 32). B's turn may reuse one token more
        # than alone: A's entry also fed B's last token, which B's own did not.
        assert two.cached_tokens >= want.cached_tokens
        no_cache, want_logprobs = _run(Runner(loaded, **SETTINGS), _turn_two(turn_one.text), 8)
        assert two.tokens == no_cache.tokens
        assert logprobs == pytest.approx(want_logprobs, abs=LOGPROB_ABS, rel=logprob_rel(None))
