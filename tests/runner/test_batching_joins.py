"""A request that joins a decode batch while another is mid-reply, on models with sliding
windows (gemma3's beside global layers, cohere2's, ministral3's): both answers as alone, every
entry's K/V as a fresh prefill of its token ids (`tests/invariants.py`, after each request),
and the next turn, which reuses those entries, with the log-probabilities of a Runner without
a cache; gemma2 too, whose mlx-lm attention put a row's mask on the wrong rows (it decoded
alone; mlxkv loads it fixed). Models whose own code cannot decode in a batch (a layer
nemotron-nas never writes, gpt_bigcode's one offset for every row) are found at load
(`probe_batched_decode`) and decode alone, said in the log."""

from __future__ import annotations

import logging

import pytest

from mlxkv import Runner
from tests.runner.test_batching import PROMPTS, _assert_same_answers, _joined_mid_reply
from tests.runner.test_batching import _tokens_and_logprobs as _answer

JOINING = ["llama", "gemma2", "gemma3_text", "gemma3", "cohere2", "ministral3"]
ALONE = ["nemotron-nas", "gpt_bigcode"]


@pytest.mark.parametrize("arch", JOINING)
def test_a_stream_joined_mid_reply_leaves_entries_the_next_turn_can_reuse(loaded_tiny, arch, rows):
    loaded = loaded_tiny(arch)
    options = {"max_tokens": 24, "temperature": 0.0, "logprobs": 0}
    alone = Runner(loaded, max_context=512, cache_entries=1, speculative=None)
    want = [_answer(alone.stream(p, **options)) for p in PROMPTS[:2]]
    runner = Runner(loaded, max_context=512, cache_entries=8, max_batch=4)
    got = _joined_mid_reply(runner, options, PROMPTS[1], options)
    _assert_same_answers(list(got), want)
    assert max(rows) == 2, "the second stream never joined the first's batch"
    for prompt, (tokens, _) in zip(PROMPTS[:2], got, strict=True):
        turn = [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": runner.tokenizer.decode(tokens)},
            {"role": "user", "content": "And then?"},
        ]
        fresh = Runner(loaded, max_context=512, cache_entries=1, speculative=None)
        _assert_same_answers(
            [_answer(runner.stream(turn, **options))], [_answer(fresh.stream(turn, **options))]
        )


@pytest.mark.parametrize("arch", ALONE)
def test_a_model_that_cannot_decode_in_a_batch_is_found_at_load_and_runs_alone(
    loaded_tiny, arch, rows, caplog
):
    loaded = loaded_tiny(arch)
    with caplog.at_level(logging.INFO, logger="mlxkv.runner.assembly"):
        runner = Runner(loaded, max_context=512, cache_entries=8, max_batch=4)
    assert runner.max_batch == 1
    assert "batched decode probe: model_type=" in caplog.text
    options = {"max_tokens": 12, "temperature": 0.0, "logprobs": 0}
    alone = Runner(loaded, max_context=512, cache_entries=1, speculative=None)
    want = [_answer(alone.stream(p, **options)) for p in PROMPTS[:2]]
    got = [_answer(runner.stream(p, batched=True, **options)) for p in PROMPTS[:2]]
    _assert_same_answers(got, want)
    assert not rows
