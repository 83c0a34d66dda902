"""Spot check of the sweep's architectures in a decode batch: two chats with a cached first
turn, decoded together through one Runner, each answer exactly as it does alone on a cold
Runner (tokens and log-probabilities), on architectures of distinct layer kinds: hybrid
GatedDeltaNet (qwen3_next), sinks with alternating windows (gpt_oss), latent attention
(deepseek_v3), KV-shared layers (gemma3n, afm7) and chunked attention (llama4)."""

from __future__ import annotations

import threading

import pytest

from mlxkv import Runner
from mlxkv.cache import make_cache
from mlxkv.cache.batched import can_batch
from mlxkv.models.loading import load_model
from mlxkv.testing.factory import build_model
from tests.factories import joined
from tests.runner.conftest import record_batch_steps
from tests.runner.test_batching import _in_step
from tests.tolerances import LOGPROB_ABS

_ARCHS = [
    "qwen3_next",
    "gpt_oss",
    "deepseek_v3",
    "gemma3n",
    "afm7",
    "llama4",
]
_GREEDY = {"max_tokens": 12, "temperature": 0.0, "logprobs": 0}


def _chats() -> list[list[dict]]:
    return [
        [{"role": "user", "content": "Tell me about the capital of France and its river."}],
        [{"role": "user", "content": "Name the capital of Italy and one famous building."}],
    ]


def _tokens_and_logprobs(stream) -> tuple[list[int], list[float]]:
    chunks = list(stream)
    return chunks[-1].completion.tokens, [c.logprob.logprob for c in chunks if c.logprob]


def _alone(loaded, follow_up: str) -> tuple[list[list[dict]], list]:
    """The two chats' second turns (the first turn's reply each cold Runner's own) and their
    answers alone on a cold Runner."""
    requests, answers = [], []
    for chat in _chats():
        cold = Runner(loaded, max_context=1024, warmup=False, speculative=None)
        reply = cold.generate(chat, max_tokens=6, temperature=0.0).text
        request = chat + [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": follow_up},
        ]
        cold.reset()
        requests.append(request)
        answers.append(_tokens_and_logprobs(cold.stream(request, **_GREEDY)))
    return requests, answers


@pytest.mark.parametrize("arch", _ARCHS)
def test_two_streams_in_a_batch_answer_as_alone(arch, tmp_path, monkeypatch):
    loaded = load_model(build_model(arch, tmp_path / arch))
    # a follow-up whose two answers both run their full length (a tiny model may stop at
    # once: then there is nothing to decode together)
    for follow_up in ("And why?", "Tell me more.", "Go on, in detail please."):
        follow_ups, want = _alone(loaded, follow_up)
        if all(len(tokens) == _GREEDY["max_tokens"] for tokens, _ in want):
            break
    else:
        pytest.fail(f"{arch}: every follow-up's answer stops early")
    chats = _chats()
    runner = Runner(loaded, max_context=1024, max_batch=4, cache_entries=4, warmup=False)
    for chat in chats:  # the first turns, cached: the batch's rows start from restored entries
        runner.generate(chat, max_tokens=6, temperature=0.0)
    steps = record_batch_steps(monkeypatch, lambda batch: batch.num_rows)
    got: list = [None, None]

    def run(i: int) -> None:
        got[i] = _tokens_and_logprobs(runner.stream(follow_ups[i], batched=True, **_GREEDY))

    runs = [lambda i=i: run(i) for i in range(2)]
    # AFM's KV-reuse queries sit at the key length, which a batch's padding moves: one place
    assert (runner.max_batch == 1) == (arch == "afm7")
    if runner.max_batch > 1:  # read in step: one reader lagging would leave the other alone
        got = [_tokens_and_logprobs(c) for c in _in_step(runner, follow_ups, **_GREEDY)]
    else:  # one place: the second stream waits for the first to end
        threads = [threading.Thread(target=one) for one in runs]
        for thread in threads:
            thread.start()
        joined(*threads, timeout_s=120)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=LOGPROB_ABS)
    if runner.max_batch > 1 and can_batch(make_cache(loaded.model)):
        assert max(steps, default=0) == 2, f"{arch}: the two streams never decoded together"
    else:
        assert not steps, f"{arch}: its layers do not batch, its streams take turns"
