"""Review: one request cancelled while its prompt is in a batched prefill with others (its
cancel set inside the pass) on models with sliding windows or recurrent state: the others
answer as each alone, it ends "cancelled", nothing stays in use, and its prompt asked again
answers as a fresh Runner (entries checked after every request by `tests/invariants.py`)."""

from __future__ import annotations

import threading

import pytest

from mlxkv import Runner
from mlxkv.runner.prefill import group as prefill_group
from tests.factories import wait_until
from tests.runner.test_batching import _assert_same_answers, _first_jobs_queued_then_run

OPTIONS = {"max_tokens": 8, "temperature": 0.0, "logprobs": 0}
QUESTIONS = ["What is a cache?", "Say a lot about windows and state, please.", "Hi there.", "Why?"]


def _chat(question):
    return [{"role": "user", "content": question}]


def _answer(chunks):
    chunks = list(chunks)
    tokens = [c.token for c in chunks if c.token is not None]
    return tokens, [c.logprob.logprob for c in chunks if c.logprob is not None]


@pytest.mark.parametrize("arch", ["gemma3_text", "lfm2", "spark2_5"])
@pytest.mark.parametrize("cancelled", [0, 1])
def test_a_request_cancelled_in_a_batched_prefill(loaded_tiny, monkeypatch, arch, cancelled):
    loaded = loaded_tiny(arch)
    fresh = Runner(loaded, max_context=512, speculative=None)
    want = [_answer(fresh.stream(_chat(q), **OPTIONS)) for q in QUESTIONS]
    runner = Runner(loaded, max_context=512, cache_entries=8, max_batch=4)
    cancel = threading.Event()
    original = prefill_group.prefill_together
    rows = []

    def cancelling(*args, **kwargs):
        cancel.set()  # the client leaves while its prompt is fed with the others
        rows.append(len(args[2]))
        return original(*args, **kwargs)

    monkeypatch.setattr(prefill_group, "prefill_together", cancelling)
    options = [dict(OPTIONS) for _ in QUESTIONS]
    options[cancelled]["cancel"] = cancel
    finishes = []
    stream = runner.stream

    def recording(prompt, **kwargs):
        chunks = list(stream(prompt, **kwargs))
        if kwargs.get("cancel") is cancel:
            finishes.append(chunks[-1].completion.finish_reason)
        return iter(chunks)

    monkeypatch.setattr(runner, "stream", recording)
    got = _first_jobs_queued_then_run(runner, [_chat(q) for q in QUESTIONS], options)
    monkeypatch.setattr(prefill_group, "prefill_together", original)
    assert rows and max(rows) >= 2, rows
    assert finishes == ["cancelled"], finishes
    others = [i for i in range(len(QUESTIONS)) if i != cancelled]
    _assert_same_answers([got[i] for i in others], [want[i] for i in others])
    wait_until(lambda: not runner._pool._in_use, what="every entry released")
    assert runner._dispatch._batching.batch.num_rows == 0
    again = _answer(stream(_chat(QUESTIONS[cancelled]), batched=True, **OPTIONS))
    _assert_same_answers([again], [want[cancelled]])
