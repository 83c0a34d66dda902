"""`keep` at its edges (issue 6 recheck): none kept (0), all of the window but one token, and a
chat whose system prompt (the default keep) is longer than the window. Each answer is compared
with a fresh Runner by log-probabilities; every entry is checked after every request by
`tests/invariants.py` (for a window that reprocesses, against a fresh prefill)."""

from __future__ import annotations

import pytest

from mlxkv import ContextLengthError, Runner
from tests.runner.test_batching import _tokens_and_logprobs
from tests.tolerances import LOGPROB_ABS

WINDOW_TOKENS = 32
LONG_PROMPT = [(3 * i + 1) % 400 for i in range(50)]
NO_EOS = {"logit_bias": {0: -100.0, 1: -100.0, 2: -100.0}}  # the factory's special tokens


@pytest.mark.parametrize("arch", ["llama", "lfm2"])  # shifts in place; reprocesses
def test_keep_zero_cuts_and_shifts_from_the_first_token(make_runner, loaded_tiny, arch):
    runner = make_runner(arch, max_context=WINDOW_TOKENS, keep=0)
    options = {"max_tokens": 4, "logprobs": 0}
    got = _tokens_and_logprobs(runner.stream(LONG_PROMPT, **options))
    fitted = LONG_PROMPT[-(WINDOW_TOKENS - 4) :]  # room to answer, nothing kept in front
    assert runner.cache_tokens[: len(fitted)] == fitted
    want = _tokens_and_logprobs(Runner(loaded_tiny(arch)).stream(fitted, **options))
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=LOGPROB_ABS)
    out = runner.generate(LONG_PROMPT[:20], max_tokens=40, **NO_EOS)
    held = runner.cache_tokens
    assert out.generation_tokens == 40 and len(held) <= WINDOW_TOKENS
    assert held[0] != LONG_PROMPT[0]  # the first tokens went with the first shift


@pytest.mark.parametrize("arch", ["llama", "lfm2"])
def test_keep_of_all_but_one_token_shifts_the_newest_out(make_runner, arch):
    """keep = window - 1: each shift drops the one token after the kept ones."""
    keep = WINDOW_TOKENS - 1
    runner = make_runner(arch, max_context=WINDOW_TOKENS, keep=keep)
    out = runner.generate(LONG_PROMPT[:10], max_tokens=40, **NO_EOS)
    assert out.generation_tokens == 40
    held = runner.cache_tokens
    assert held[:keep] == (LONG_PROMPT[:10] + out.tokens)[:keep]
    assert len(held) <= WINDOW_TOKENS


@pytest.mark.parametrize("arch", ["llama", "lfm2"])
def test_a_system_prompt_longer_than_the_window_is_a_clear_error(make_runner, arch):
    runner = make_runner(arch, max_context=48)
    chat = [
        {"role": "system", "content": "You are a helpful assistant. " * 10},
        {"role": "user", "content": "hi"},
    ]
    with pytest.raises(ContextLengthError, match="shorten the system prompt"):
        runner.generate(chat, max_tokens=4)
    assert runner.cache_tokens == []  # nothing ran
    short = [{"role": "user", "content": "hi"}]
    assert (
        runner.generate(short, max_tokens=4).tokens
        == Runner(runner.loaded).generate(short, max_tokens=4).tokens
    )
