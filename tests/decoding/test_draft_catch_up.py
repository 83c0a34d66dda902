"""A draft model far behind the text (a new conversation's long prompt, the kept text after a
shift its cache cannot follow in place) catches up a prefill chunk per draft asked for,
decoding plainly meanwhile, instead of prefilling the whole text in one call that no cancel
and no request joining the batch could interrupt. Reference: a drafter caught up in one go
(the drafts), plain decoding on a fresh Runner (the reply)."""

from __future__ import annotations

import dataclasses

import pytest

from mlxkv import Runner
from mlxkv.cache.building import make_cache
from mlxkv.decoding.drafts import DraftModel
from mlxkv.decoding.prefill.chunks import PrefillPlan
from tests.tolerances import LOGPROB_ABS

STEP_TOKENS = 16
TEXT = [(7 * i + 3) % 97 + 1 for i in range(3 * STEP_TOKENS + 5)]  # 53 tokens: 4 chunks


def test_a_draft_model_catches_up_a_chunk_per_draft_asked_for(loaded_tiny):
    loaded = loaded_tiny("llama")
    draft = DraftModel(loaded, loaded.vocab_size)
    chunked = draft.drafter(draft.make_cache(), TEXT, None, PrefillPlan(STEP_TOKENS))
    cache = chunked._cache
    held = []
    while not (proposed := chunked.propose(4)).tokens:
        held.append(cache.num_tokens)
        assert len(held) < 10, held  # bounded: it must catch up
    assert held == [16, 32, 48]  # a chunk per call, no drafts until caught up
    whole = draft.drafter(make_cache(loaded.model), TEXT, None, PrefillPlan(512))
    assert proposed.tokens == whole.propose(4).tokens
    assert cache.tokens == TEXT + proposed.tokens[:-1]


def test_a_long_prompt_with_a_draft_model_replies_as_plain_decoding(loaded_tiny):
    """The prompt takes several prefill chunks: the first tokens are decoded plainly while the
    draft model catches up, then drafted; tokens and log-probabilities are plain decoding's."""
    loaded = loaded_tiny("llama")
    prompt = TEXT * 2
    options = {"max_tokens": 24, "temperature": 0.0, "logprobs": 0}
    plain = list(Runner(loaded, speculative=None).stream(prompt, **options))
    drafted_runner = Runner(
        loaded, draft=dataclasses.replace(loaded), prefill_step_size=STEP_TOKENS
    )
    drafted = list(drafted_runner.stream(prompt, speculative="draft", **options))
    got, want = drafted[-1].completion, plain[-1].completion
    assert got.tokens == want.tokens
    assert [c.logprob.logprob for c in drafted[:-1]] == pytest.approx(
        [c.logprob.logprob for c in plain[:-1]], abs=LOGPROB_ABS
    )
    assert got.drafted_tokens > 0  # caught up within the reply
