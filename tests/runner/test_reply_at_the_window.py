"""Where a reply meets the window (`max_context`): the window bounds what the cache holds and
what the model attends to. A reply's last token is sampled from the full window and never fed,
so under `overflow="shift"` a reply ends one token past the window without a shift, and its
tokens are an unlimited window's; one token more shifts. "stop" (and "refuse") count as the
APIs do, prompt + reply within the window (docs/long-conversations.md)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

WINDOW = 40
PROMPT = [(5 * i + 11) % 500 for i in range(30)]


def _reply(runner, max_tokens: int, overflow: str) -> tuple:
    chunks = list(
        runner.stream(PROMPT, max_tokens=max_tokens, temperature=0, logprobs=0, overflow=overflow)
    )
    return chunks[-1].completion, [c.logprob.logprob for c in chunks if c.logprob]


def _shifts(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "context shift" in r.getMessage()]


@pytest.mark.parametrize("speculative", ["off", "auto"])
def test_a_reply_ends_one_token_past_the_window_without_a_shift(make_runner, caplog, speculative):
    runner = make_runner(max_context=WINDOW, speculative=speculative)
    max_tokens = WINDOW - len(PROMPT) + 1
    with caplog.at_level(logging.INFO, logger="mlxkv"):
        got, got_logprobs = _reply(runner, max_tokens, "shift")
    assert _shifts(caplog) == []
    assert got.prompt_tokens + got.generation_tokens == WINDOW + 1
    assert len(runner.cache_tokens) == WINDOW  # the last token sampled, never fed
    wide = make_runner(max_context=2 * WINDOW, speculative=speculative)
    want, want_logprobs = _reply(wide, max_tokens, "shift")
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got_logprobs, want_logprobs, atol=1e-4)


def test_one_token_more_shifts_and_the_cache_stays_within_the_window(make_runner, caplog):
    runner = make_runner(max_context=WINDOW)
    with caplog.at_level(logging.INFO, logger="mlxkv"):
        got, _ = _reply(runner, WINDOW - len(PROMPT) + 2, "shift")
    assert len(_shifts(caplog)) == 1
    assert got.generation_tokens == WINDOW - len(PROMPT) + 2
    assert len(runner.cache_tokens) <= WINDOW


def test_stop_ends_the_reply_where_prompt_and_reply_fill_the_window(make_runner):
    got, _ = _reply(make_runner(max_context=WINDOW), WINDOW, "stop")
    assert got.finish_reason == "length"
    assert got.prompt_tokens + got.generation_tokens == WINDOW
