"""A draft model drafts through the request's penalties and logit bias with the token history
the model's picker has at each draft (f41058d): the prompt, every token accepted, the token
drawn after each verification, the drafts before it in the same pass, never shifted with the
window. The model drafting for itself (the same weights) then has every draft accepted, greedy
or sampled (p equals q: speculative sampling accepts with probability min(1, p/q) = 1), on
each path where the history could part from the picker's: a reply past the window (the draft
cache follows the shifts), later turns reusing the draft cache, and a reply that goes into the
batch when another request comes and drafts again alone when it leaves (review rs11)."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from mlxkv import Runner
from mlxkv.decoding.drafts import ModelDrafter
from tests.factories import joined
from tests.runner.test_batching import PROMPTS

MESSAGES = [{"role": "user", "content": "Count the colors: red blue green red blue green."}]
SETTINGS = {
    "repetition": {"repetition_penalty": 1.5},
    "negative-presence": {"presence_penalty": -2.0},
    "logit-bias": {"logit_bias": {65: 5.0, 66: 3.0}},
}
TEMPERATURES = {"greedy": 0.0, "sampled": 0.9}


def _self_drafting(loaded, **options) -> Runner:
    return Runner(loaded, draft=dataclasses.replace(loaded), **options)


def _all_accepted(completion) -> bool:
    return completion.accepted_tokens == completion.drafted_tokens > 0


@pytest.mark.parametrize("temperature", list(TEMPERATURES.values()), ids=list(TEMPERATURES))
@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])  # shifted in place; prefilled again
def test_every_draft_is_accepted_past_the_window(loaded_tiny, arch, name, temperature):
    loaded = loaded_tiny(arch)
    window = len(Runner(loaded).encode(MESSAGES)) + 8
    runner = _self_drafting(loaded, max_context=window)
    options = {"temperature": temperature, "seed": 7, **SETTINGS[name]}
    completion = runner.generate(MESSAGES, max_tokens=60, speculative="draft", **options)
    assert len(completion.tokens) > 8, "the reply never went past the window"
    assert _all_accepted(completion), completion


@pytest.mark.parametrize("temperature", list(TEMPERATURES.values()), ids=list(TEMPERATURES))
@pytest.mark.parametrize("name", list(SETTINGS))
def test_every_draft_is_accepted_on_later_turns(loaded_tiny, name, temperature):
    runner = _self_drafting(loaded_tiny("llama"), max_context=2048)
    messages = list(MESSAGES)
    for turn in range(3):
        options = {"temperature": temperature, "seed": 7 + turn, **SETTINGS[name]}
        completion = runner.generate(messages, max_tokens=30, speculative="draft", **options)
        assert _all_accepted(completion), (turn, completion)
        assert turn == 0 or completion.cached_tokens > 0
        messages += [
            {"role": "assistant", "content": completion.text},
            {"role": "user", "content": f"And then {turn}?"},
        ]


@pytest.mark.parametrize("name", list(SETTINGS))
def test_every_draft_is_accepted_alone_again_after_the_batch(loaded_tiny, name, rows, monkeypatch):
    """The first stream drafts alone, decodes in the batch beside a second, and drafts alone
    again once that one has ended (its history then holds the tokens picked in the batch)."""
    drafted_at = []  # batched steps taken so far, at each draft proposed
    propose = ModelDrafter.propose

    def counted(self, limit):
        draft = propose(self, limit)
        if draft.tokens:
            drafted_at.append(len(rows))
        return draft

    monkeypatch.setattr(ModelDrafter, "propose", counted)
    runner = _self_drafting(loaded_tiny("llama"), max_context=512, cache_entries=8, max_batch=4)
    options = {"max_tokens": 96, "temperature": 0.0, **SETTINGS[name]}
    first = runner.stream(PROMPTS[0], batched=True, speculative="draft", **options)
    chunks = [next(first) for _ in range(3)]
    assert runner._dispatch._batching.batch.num_rows == 0  # alone, drafting
    started, resumed = threading.Event(), threading.Event()

    def read_second() -> None:
        for n, _ in enumerate(runner.stream(PROMPTS[1], batched=True, max_tokens=24), 1):
            if n == 1:
                started.set()
                resumed.wait(30)

    second = threading.Thread(target=read_second)
    second.start()
    assert started.wait(30)
    # The second is decoding (its first token read), so the first hands over to the batch;
    # the second's row joins only when its reader asks for its second token.
    while not rows:  # bounded by its max_tokens: the stream would end
        chunks.append(next(first))
    assert max(rows) == 1  # the first, in the batch
    resumed.set()  # the second joins it there
    joined(second)
    assert max(rows) == 2, "the first stream never decoded in the batch beside the second"
    chunks += list(first)
    completion = chunks[-1].completion
    assert _all_accepted(completion), completion
    assert drafted_at[-1] == len(rows), "it never drafted again after the batch"
