"""The logits processors (repetition, presence and frequency penalties, logit bias) and stop
strings, per request, on every path a request can take besides plain decoding: verified
drafts (n-gram and a draft model), a batch whose rows each carry other settings, rows
cancelled mid-batch, a reply past the window, and a turn that reuses a cached prefix from
memory or from the disk tier. Each answer's greedy tokens and log-probabilities equal the
same request alone on a fresh Runner with speculation off (issues 12, 27 and 11 recheck).
Every entry is checked after every request by `tests/invariants.py`."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from mlxkv import Runner
from tests.runner.test_batching import _in_step, _queued_then_run, _tokens_and_logprobs
from tests.tolerances import LOGPROB_ABS

PROMPT = "one two three four five six seven eight nine ten. " * 6
MESSAGES = [{"role": "user", "content": "Count the colors: red blue green red blue green."}]
SETTINGS = {
    "repetition": {"repetition_penalty": 1.5},
    "presence": {"presence_penalty": 1.5},
    "frequency": {"frequency_penalty": 1.5},
    "negative-presence": {"presence_penalty": -2.0},
    "logit-bias": {"logit_bias": {65: 5.0, 66: 3.0}},
}
# each row of one batch with settings of its own: penalties, a bias, a stop string, a length
# inside the others' replies, a seeded sampled row (it decodes alone, taking turns)
ROWS = [
    ("The first request, about caches.", {"presence_penalty": 1.5}),
    ("Another one, longer, about memory and more.", {"logit_bias": {65: 4.0}}),
    ("Third.", {"repetition_penalty": 1.4}),
    ("The fourth request of this test asks about batches.", {"frequency_penalty": 1.0}),
    ("Fifth with a stop.", {"stop": ["e"]}),
    ("Sixth, sampled with a seed.", {"temperature": 0.8, "seed": 11, "max_tokens": 9}),
]


def _answer(runner, prompt, **options):
    """(tokens, logprobs) and the completion of one greedy request (unless options say)."""
    options = {"temperature": 0.0, "logprobs": 0, **options}
    chunks = list(runner.stream(prompt, **options))
    return _tokens_and_logprobs(chunks), chunks[-1].completion


def _alone(loaded, prompt, max_context=1024, **options):
    return _answer(Runner(loaded, max_context=max_context, speculative=None), prompt, **options)[0]


def _assert_same(got, want):
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=LOGPROB_ABS, rel=1e-4)


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("mode", ["ngram", "draft"])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_verified_drafts_apply_the_processors_as_plain_decoding(loaded_tiny, arch, mode, name):
    loaded = loaded_tiny(arch)
    settings = SETTINGS[name]
    want = _alone(loaded, PROMPT, max_tokens=40, **settings)
    draft = dataclasses.replace(loaded) if mode == "draft" else None
    runner = Runner(loaded, max_context=1024, draft=draft)
    got, completion = _answer(runner, PROMPT, max_tokens=40, speculative=mode, **settings)
    _assert_same(got, want)
    if mode == "draft":  # the model drafting for itself, through the same processors
        assert completion.accepted_tokens == completion.drafted_tokens > 0


@pytest.mark.parametrize("name", ["repetition", "logit-bias"])
@pytest.mark.parametrize("mode", [None, "ngram", "draft"])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "lfm2"])
def test_a_reply_past_the_window_with_processors_equals_plain(loaded_tiny, arch, mode, name):
    """Shifted in place (llama) or by prefilling the kept tokens again (the others), with the
    processors reading the history across every shift."""
    loaded = loaded_tiny(arch)
    settings = SETTINGS[name]
    window = len(Runner(loaded).encode(MESSAGES)) + 8
    want = _alone(loaded, MESSAGES, max_context=window, max_tokens=60, **settings)
    draft = dataclasses.replace(loaded) if mode == "draft" else None
    runner = Runner(loaded, max_context=window, draft=draft)
    got, _ = _answer(runner, MESSAGES, max_tokens=60, speculative=mode, **settings)
    _assert_same(got, want)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "lfm2"])
def test_batched_rows_each_with_their_own_settings_answer_as_alone(loaded_tiny, arch, rows):
    loaded = loaded_tiny(arch)
    options = [{"max_tokens": 20, **settings} for _, settings in ROWS]
    want = [
        _answer(Runner(loaded, max_context=512), p, **o)
        for (p, _), o in zip(ROWS, options, strict=True)
    ]
    runner = Runner(loaded, max_context=512, cache_entries=8, max_batch=len(ROWS))
    read = _in_step(runner, [p for p, _ in ROWS], each=options, temperature=0.0, logprobs=0)
    got = [(_tokens_and_logprobs(chunks), chunks[-1].completion) for chunks in read]
    for (answer, completion), (want_answer, want_completion) in zip(got, want, strict=True):
        _assert_same(answer, want_answer)
        assert completion.finish_reason == want_completion.finish_reason
    assert max(rows) >= 4, "the rows hardly decoded together"


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "lfm2", "mamba"])
def test_rows_cancelled_mid_batch_leave_the_others_exact_and_continue(loaded_tiny, arch):
    loaded = loaded_tiny(arch)
    prompts = [prompt for prompt, _ in ROWS[:4]]
    settings = [settings for _, settings in ROWS[:4]]
    want = [
        _alone(loaded, p, max_context=512, max_tokens=24, **s)
        for p, s in zip(prompts, settings, strict=True)
    ]
    runner = Runner(loaded, max_context=512, cache_entries=8, max_batch=4)
    cancels = [threading.Event() for _ in prompts]
    cancelled_after = {0: 3, 2: 5}  # row: chunks read before its cancel is set
    got: list = [None] * len(prompts)

    def run(i):
        chunks = []
        options = {"temperature": 0.0, "logprobs": 0, "max_tokens": 24, **settings[i]}
        for chunk in runner.stream(prompts[i], batched=True, cancel=cancels[i], **options):
            chunks.append(chunk)
            if len(chunks) == cancelled_after.get(i):
                cancels[i].set()
        got[i] = (_tokens_and_logprobs(chunks), chunks[-1].completion.finish_reason)

    _queued_then_run(runner, [lambda i=i: run(i) for i in range(len(prompts))])
    for i, ((tokens, logprobs), reason) in enumerate(got):
        if i in cancelled_after:
            assert reason == "cancelled" and tokens == want[i][0][: len(tokens)]
            again = runner.generate(prompts[i], max_tokens=24, temperature=0.0, **settings[i])
            assert again.tokens == want[i][0] and again.cached_tokens > 0
        else:
            _assert_same((tokens, logprobs), want[i])


@pytest.mark.parametrize("batched", [False, True], ids=["alone", "batched"])
@pytest.mark.parametrize("name", ["repetition", "presence", "frequency"])
@pytest.mark.parametrize("arch", ["llama", "lfm2"])
def test_a_turn_on_a_cached_prefix_penalizes_the_whole_history(
    loaded_tiny, tmp_path, arch, name, batched
):
    """The penalties read the prompt's tokens, cached or not: a turn that reuses its
    conversation from memory, then from the disk tier after a restart, equals a cold one."""
    loaded = loaded_tiny(arch)
    settings = {**SETTINGS[name], "batched": batched}
    chat = [{"role": "user", "content": "blue blue red red green one two three blue red"}]
    config = {"max_context": 512, "cache_entries": 4, "cache_dir": tmp_path}
    runner = Runner(loaded, **config)
    first = runner.generate(chat, max_tokens=10, temperature=0.0, **settings)
    chat += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "red blue"}]
    want = _alone(loaded, chat, max_context=512, max_tokens=20, **SETTINGS[name])
    got, completion = _answer(runner, chat, max_tokens=20, **settings)
    _assert_same(got, want)
    assert completion.cached_tokens > 0
    runner.close()
    got, completion = _answer(Runner(loaded, **config), chat, max_tokens=20, **settings)
    _assert_same(got, want)
    assert completion.cached_tokens > 0  # from the disk tier
