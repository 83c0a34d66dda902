"""A vision model's text-only batched requests are prefilled together, as a text model's are
(`mlxkv.runner.prefill.group`), while a prompt with images beside them is prefilled alone
(its calls carry its own encoder rows and positions): per family, each answer (greedy tokens
and log-probabilities) equals the same request alone on a fresh Runner, a row holding a
cached first turn included; a request cancelled inside the batched pass, or whose client
leaves mid-batch, leaves the others exact and nothing in use. Every entry is checked after
every request by `tests/invariants.py`."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("mlx_vlm")

from mlxkv import Runner  # noqa: E402
from mlxkv.models.loading import load_model  # noqa: E402
from mlxkv.models.vision import PLACEHOLDER_BASE  # noqa: E402
from mlxkv.runner.prefill import group as group_module  # noqa: E402
from mlxkv.testing.vision_factory import FAMILIES, build_vision_model, noise_images  # noqa: E402
from tests.factories import recorded, wait_until  # noqa: E402
from tests.runner.test_batching import (  # noqa: E402
    _assert_same_answers,
    _first_jobs_queued_then_run,
    _tokens_and_logprobs,
)
from tests.runner.test_vision_batch import _user  # noqa: E402

OPTIONS = {"max_tokens": 8, "temperature": 0.0, "logprobs": 0}
QUESTIONS = [
    "What is a cache?",
    "Say a lot about windows and state, please.",
    "Hi there.",
    "Because of the rain?",
]


@pytest.fixture(scope="module", params=FAMILIES)
def loaded(tmp_path_factory, request):
    out = tmp_path_factory.mktemp("vlm") / request.param
    return load_model(build_vision_model(out, family=request.param))


@pytest.fixture(scope="module")
def image():
    return noise_images(3, [(56, 56, 3)])[0]


@pytest.fixture
def passes(monkeypatch):
    """Every batched prefill requests take (not the load's warm-up's, which runs before):
    (its rows' cached tokens, sorted; whether any row feeds an image's placeholders)."""

    def measure(_model, caches, prompts, **_):
        images = any(t >= PLACEHOLDER_BASE for prompt in prompts for t in prompt)
        return sorted(cache.num_tokens for cache in caches), images

    return recorded(monkeypatch, group_module, "prefill_together", measure)


def _chat(question):
    return [{"role": "user", "content": question}]


def _alone(loaded, prompt):
    runner = Runner(loaded, max_context=1024, speculative=None)
    return _tokens_and_logprobs(runner.stream(prompt, **OPTIONS))


def test_text_prompts_are_prefilled_together_beside_one_with_an_image(loaded, image, passes):
    runner = Runner(loaded, max_context=1024, cache_entries=8, max_batch=8, speculative=None)
    first = _chat("Name three colors.")
    reply = runner.generate(first, **OPTIONS).text
    second = first + [{"role": "assistant", "content": reply}, _chat("And three shapes?")[0]]
    prompts = [second, *map(_chat, QUESTIONS[:3]), [_user(image, "What is in this picture?")]]
    want = [_alone(loaded, prompt) for prompt in prompts]
    got = _first_jobs_queued_then_run(runner, prompts, [OPTIONS] * len(prompts))
    _assert_same_answers(got, want)
    assert len({tuple(tokens) for tokens, _ in want}) == len(want), "the model tells them apart"
    assert len(passes) == 1, passes
    cached, images = passes[0]
    assert len(cached) == 4 and cached[-1] > 0, "the four text rows, the second turn's cached"
    assert not images, "a prompt with images is prefilled alone"


@pytest.mark.parametrize("leaves", ["cancelled", "closed"])
def test_a_row_that_ends_in_the_batch_leaves_the_others_exact(loaded, passes, monkeypatch, leaves):
    """One text request is cancelled inside the batched pass (its cancel set there), or its
    client closes the stream after three tokens (decoding in the batch by then); the others
    answer as alone, nothing stays in use, and asked again it answers as a fresh Runner."""
    want = [_alone(loaded, _chat(q)) for q in QUESTIONS]
    runner = Runner(loaded, max_context=1024, cache_entries=8, max_batch=4, speculative=None)
    # the chat template's head cached: no request waits for another to feed it, all 4 meet
    runner.generate(_chat("Hello."), **OPTIONS)
    mine, ends = threading.Event(), []
    if leaves == "cancelled":
        original = group_module.prefill_together

        def cancelling(*args, **kwargs):
            mine.set()  # the client leaves while its prompt is fed with the others
            return original(*args, **kwargs)

        monkeypatch.setattr(group_module, "prefill_together", cancelling)
    stream = runner.stream

    def leaving(prompt, **kwargs):
        chunks = stream(prompt, **kwargs)
        if kwargs.get("cancel") is not mine:
            return chunks
        if leaves == "closed":
            kept = [next(chunks) for _ in range(3)]
            chunks.close()  # a client that went away
            ends.append("closed")
            return iter(kept)
        kept = list(chunks)
        ends.append(kept[-1].completion.finish_reason)
        return iter(kept)

    monkeypatch.setattr(runner, "stream", leaving)
    options = [dict(OPTIONS) for _ in QUESTIONS]
    options[0]["cancel"] = mine
    got = _first_jobs_queued_then_run(runner, [_chat(q) for q in QUESTIONS], options)
    assert ends == [leaves], ends
    assert [len(cached) for cached, _ in passes] == [len(QUESTIONS)], passes
    _assert_same_answers(got[1:], want[1:])
    wait_until(lambda: not runner._pool._in_use, what="every entry released")
    assert runner._dispatch._batching.batch.num_rows == 0
    again = _tokens_and_logprobs(stream(_chat(QUESTIONS[0]), batched=True, **OPTIONS))
    _assert_same_answers([again], want[:1])
