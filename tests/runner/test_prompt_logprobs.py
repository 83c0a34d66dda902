"""A prompt's own log-probabilities (`Runner.stream(prompt_logprobs=k)`): each prompt token's
given those before it, checked against the model called on the whole prompt with no cache;
the same when the cache supplies a prefix (fed again on a cache of its own), across chunk
and checkpoint boundaries, for attention, sliding-window and recurrent layers, batched
beside other requests; the cache holds exactly the prompt and reply after it (checked after
every request: `tests/invariants.py`)."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest

from mlxkv import Runner
from mlxkv.decoding.prefill import scoring
from tests.tolerances import LOGPROB_ABS

TEXT = "the cat sat on a mat and then it ran far away to the sea"


def _prompt(loaded, words: int) -> list[int]:
    vocabulary = TEXT.split()
    return loaded.tokenizer.encode(" ".join(vocabulary[i % len(vocabulary)] for i in range(words)))


def _reference(loaded, tokens: list[int]) -> np.ndarray:
    """Log-probabilities (n, vocab) of the model called once on `tokens`, no cache kept."""
    logits = loaded.model(mx.array([tokens]))[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def _check(loaded, scored, tokens: list[int], top: int) -> None:
    want = _reference(loaded, tokens)
    assert scored.tokens == tokens and len(scored.logprobs) == len(tokens) - 1
    own = [each.logprob for each in scored.logprobs]
    expected = [want[i, tokens[i + 1]] for i in range(len(tokens) - 1)]
    np.testing.assert_allclose(own, expected, atol=LOGPROB_ABS, rtol=1e-4)
    for position, each in enumerate(scored.logprobs):
        assert len(each.top) == top
        values = [value for _, value in each.top]
        assert values == sorted(values, reverse=True)
        best = np.sort(want[position])[::-1][:top]
        np.testing.assert_allclose(values, best, atol=LOGPROB_ABS, rtol=1e-4)
        for token, value in each.top:
            assert want[position, token] == pytest.approx(value, abs=LOGPROB_ABS, rel=1e-4)


def _scored(runner, tokens, top: int = 3, **options):
    chunks = list(runner.stream(tokens, prompt_logprobs=top, max_tokens=2, **options))
    firsts = [c.prompt_logprobs for c in chunks if c.prompt_logprobs is not None]
    assert len(firsts) == 2 and firsts[0] is firsts[1]  # the first token's and the last
    return firsts[0], chunks[-1].completion


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "lfm2", "mamba"])
def test_prompt_logprobs_are_the_models_with_or_without_a_cached_prefix(loaded_tiny, arch):
    loaded = loaded_tiny(arch)
    runner = Runner(loaded, max_context=512, prefill_step_size=16, cache_entries=4)
    first = _prompt(loaded, 30)
    scored, completion = _scored(runner, first)
    _check(loaded, scored, first, 3)
    assert completion.cached_tokens == 0
    longer = first + completion.tokens + _prompt(loaded, 21)
    scored, completion = _scored(runner, longer)
    assert completion.cached_tokens >= len(first)  # the prefix came from the cache
    _check(loaded, scored, longer, 3)
    assert runner.cache_tokens == longer + completion.tokens[:-1]


def test_prompt_logprobs_beside_batched_requests(loaded_tiny):
    """Scored while other streams prefill and decode in the batch: the same numbers, and the
    others' replies are what they are alone."""
    loaded = loaded_tiny("llama")
    runner = Runner(loaded, max_context=512, prefill_step_size=16, cache_entries=6, max_batch=4)
    prompts = [_prompt(loaded, 12 + 7 * i) for i in range(3)]
    alone = [Runner(loaded, max_context=512).generate(p, max_tokens=6).tokens for p in prompts]
    results: dict[int, object] = {}
    start = threading.Barrier(4)

    def run(index: int) -> None:
        start.wait(timeout=30)
        if index == 3:
            results[index] = _scored(runner, _prompt(loaded, 40), batched=True)[0]
        else:
            results[index] = runner.generate(prompts[index], max_tokens=6, batched=True).tokens

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    _check(loaded, results[3], _prompt(loaded, 40), 3)
    assert [results[i] for i in range(3)] == alone


def test_no_alternatives_and_a_bad_count(loaded_tiny):
    loaded = loaded_tiny("llama")
    runner = Runner(loaded, max_context=512)
    tokens = _prompt(loaded, 10)
    scored, _ = _scored(runner, tokens, top=0)
    _check(loaded, scored, tokens, 0)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        runner.generate(tokens, prompt_logprobs=21)
    assert list(runner.stream(tokens, max_tokens=1))[0].prompt_logprobs is None


def test_a_cancel_while_the_cached_prefix_is_scored_ends_the_request(loaded_tiny):
    """Cancelled between the chunks that score the cached prefix again: it ends "cancelled"
    and the entry keeps the prompt it fed."""
    loaded = loaded_tiny("llama")
    runner = Runner(loaded, max_context=512, prefill_step_size=8)
    first = _prompt(loaded, 40)
    runner.generate(first, max_tokens=1)
    cancel = threading.Event()
    tokens = first + _prompt(loaded, 3)

    def progress_then_cancel(done: int, total: int) -> None:
        if done == total:  # the uncached part fed: the scoring of the prefix comes next
            cancel.set()

    chunks = runner.stream(
        tokens, prompt_logprobs=1, max_tokens=4, cancel=cancel, progress=progress_then_cancel
    )
    last = list(chunks)[-1]
    assert last.finish_reason == "cancelled" and last.prompt_logprobs is None
    assert runner.cache_tokens[: len(tokens)] == tokens


def test_a_scored_prefill_is_not_measured_as_the_prefill_rate(loaded_tiny):
    """The rate that weighs disk loads against prefilling is a plain prefill's: a scored one
    also computes every position's logits (and feeds a cached prefix again)."""
    loaded = loaded_tiny("llama")
    runner = Runner(loaded, max_context=512, prefill_step_size=8)
    _scored(runner, _prompt(loaded, 40))
    assert runner._pool.prefill_tokens_per_s is None
    runner.generate(_prompt(loaded, 41)[::-1], max_tokens=1)
    assert runner._pool.prefill_tokens_per_s is not None


def test_a_scored_prefill_feeds_chunks_of_at_most_the_scored_step(loaded_tiny, monkeypatch):
    """Each chunk's logits over the vocabulary are kept in float32: a 2,048-token step (a
    GPU's) of a 152k vocabulary held 1.2 GB a copy; a scored prefill feeds at most
    `SCORED_STEP_TOKENS` a call, its cached prefix too."""
    loaded = loaded_tiny("llama")
    runner = Runner(loaded, max_context=2048, prefill_step_size=1024)
    tokens = _prompt(loaded, 700)
    runner.generate(tokens[:400], max_tokens=1)
    rows: list[int] = []
    score = scoring.PromptScorer.score
    monkeypatch.setattr(
        scoring.PromptScorer, "score", lambda self, logits, at: rows.append(logits.shape[1])
        or score(self, logits, at),
    )  # fmt: skip
    scored, completion = _scored(runner, tokens)
    assert completion.cached_tokens >= 399 and max(rows) == scoring.SCORED_STEP_TOKENS
    assert sum(rows) == len(tokens) - 1
    _check(loaded, scored, tokens, 3)
