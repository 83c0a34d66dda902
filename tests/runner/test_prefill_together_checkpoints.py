"""Chat requests arriving together on models whose layers cannot all trim back (sliding windows:
Gemma 3, spark2_5; recurrent state: LFM2, which reads `ArraysCache.lengths`; Mamba, whose
state takes the padding in) against the same conversations run one at a time: prefilled in one
batched pass where the layers and the probe at load allow (Mamba alone), the same tokens and
log-probabilities, entries with the checkpoints a plain prefill leaves (where each reply
starts), and a regenerated reply and a next turn going back to them, answering as a fresh
Runner does. Every entry is checked after every request by `tests/invariants.py`."""

from __future__ import annotations

import pytest

from mlxkv import Runner
from mlxkv.runner.prefill import group as prefill_group
from mlxkv.runner.prefill.group import PrefillGroup
from tests.factories import recorded
from tests.runner.test_batching import _assert_same_answers, _first_jobs_queued_then_run

OPTIONS = {"max_tokens": 12, "temperature": 0.0, "logprobs": 0}
QUESTIONS = [
    "What is a cache?",
    "Say something about sliding windows and recurrent state, at some length please.",
    "Hi.",
]
SETTINGS = {"max_context": 512, "cache_entries": 8}


def _chat(question):
    return [{"role": "user", "content": question}]


def _answer(chunks):
    chunks = list(chunks)
    tokens = [c.token for c in chunks if c.token is not None]
    logprobs = [c.logprob.logprob for c in chunks if c.logprob is not None]
    return (tokens, logprobs), chunks[-1].completion


def _checkpoints(runner) -> list[list[int]]:
    """Each entry's checkpoint lengths, entries in the order of their prompts' first tokens."""
    entries = sorted(runner._pool.entries, key=lambda entry: entry.cache.tokens)
    return [sorted(entry.cache.checkpoints) for entry in entries]


def _interleaved(loaded, monkeypatch, *, together: bool):
    """The chats sent at once to a Runner that batches (its first jobs all queued before any
    runs), their prompts prefilled together where the group admits them, or (not `together`)
    each alone as before; the answers and the Runner."""
    runner = Runner(loaded, max_batch=4, **SETTINGS)
    with monkeypatch.context() as patch:
        if not together:
            patch.setattr(PrefillGroup, "admits", lambda *_: False)
        chats = [_chat(q) for q in QUESTIONS]
        return _first_jobs_queued_then_run(runner, chats, [OPTIONS] * len(chats)), runner


@pytest.mark.parametrize("arch", ["gemma3_text", "spark2_5", "lfm2", "mamba"])
def test_chats_prefilled_together_keep_the_checkpoints_of_a_plain_prefill(
    loaded_tiny, arch, monkeypatch
):
    loaded = loaded_tiny(arch)
    alone = Runner(loaded, speculative=None, **SETTINGS)
    want = [_answer(alone.stream(_chat(q), **OPTIONS)) for q in QUESTIONS]
    _, plain = _interleaved(loaded, monkeypatch, together=False)
    passes = recorded(
        monkeypatch, prefill_group, "prefill_together",
        lambda _model, _caches, _prompts, stops, **_: [s.checkpoints for s in stops],
    )  # fmt: skip
    got, runner = _interleaved(loaded, monkeypatch, together=True)
    _assert_same_answers(got, [answer for answer, _ in want])
    if arch == "mamba":  # its state reads the padding (the probe at load): each alone
        assert passes == []
    else:  # the first fed its prompt's shared head alone; the two others copied it, then
        # were fed together, each with its checkpoint where its reply starts
        assert passes and all(len(points) == 1 for points in passes[0]), passes
    assert _checkpoints(runner) == _checkpoints(plain)
    assert all(_checkpoints(runner)), "an entry without the checkpoint where its reply starts"
    fresh = Runner(loaded, speculative=None, max_context=512)
    for question, (answer, done) in zip(QUESTIONS, want, strict=True):
        # the same chat again (a regenerated reply): back to the checkpoint where it starts
        again, again_done = _answer(runner.stream(_chat(question), batched=True, **OPTIONS))
        _assert_same_answers([again], [answer])
        assert 0 < again_done.cached_tokens < again_done.prompt_tokens
        # the next turn: the reply as the chat template renders it, then a new message
        turn = [
            *_chat(question),
            {"role": "assistant", "content": done.text},
            {"role": "user", "content": "And then?"},
        ]
        fresh_answer, _ = _answer(fresh.stream(turn, **OPTIONS))
        next_answer, next_done = _answer(runner.stream(turn, batched=True, **OPTIONS))
        _assert_same_answers([next_answer], [fresh_answer])
        assert next_done.cached_tokens >= again_done.cached_tokens
