"""A vision model's batched requests, text-only or with images, are prefilled together as a
text model's are (`mlxkv.runner.prefill.group`; rows with images run on `PromptRows` of
`mlxkv.runner.prefill.image_rows`, each row its own encoder rows and positions): per family,
each answer (greedy tokens and log-probabilities) equals the same request alone on a fresh
Runner, a row after a cached image turn and a row with two images of different sizes
included; a request (with an image or text only) cancelled inside the batched pass, or whose
client leaves mid-batch, leaves the others exact and nothing in use. Every entry is checked
after every request by `tests/invariants.py`."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("mlx_vlm")

from mlxkv import Runner  # noqa: E402
from mlxkv.models.vision import PLACEHOLDER_BASE  # noqa: E402
from mlxkv.runner.prefill import group as group_module  # noqa: E402
from mlxkv.testing.vision_factory import noise_images  # noqa: E402
from tests.factories import recorded, wait_until  # noqa: E402
from tests.runner.test_batching import (  # noqa: E402
    _assert_same_answers,
    _first_jobs_queued_then_run,
    _tokens_and_logprobs,
)
from tests.runner.vision.test_vision_batch import _user  # noqa: E402

OPTIONS = {"max_tokens": 8, "temperature": 0.0, "logprobs": 0}
QUESTIONS = [
    "What is a cache?",
    "Say a lot about windows and state, please.",
    "Hi there.",
    "Because of the rain?",
]


@pytest.fixture(scope="module")
def images():
    """Two of the same size, one larger (more tokens)."""
    return noise_images(3, [(56, 56, 3), (56, 56, 3), (84, 112, 3)])


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


def test_prompts_with_and_without_images_are_prefilled_together_as_alone(loaded, images, passes):
    """Rows: an image conversation's second turn (its first turn cached: text after its
    image), one image, two images of different sizes, two text prompts."""
    runner = Runner(loaded, max_context=1024, cache_entries=8, max_batch=8, speculative=None)
    # the chat template's head in an idle entry: no row waits for another to feed it
    runner.generate(_chat("Hello."), **OPTIONS)
    first = [_user(images[0], "Name three colors in it.")]
    reply = runner.generate(first, **OPTIONS).text
    second = first + [{"role": "assistant", "content": reply}, _user("And three shapes?")]
    prompts = [
        second,
        # each starts its own way: none waits for another to feed a shared start
        [_user("Look:", images[1], "what is in this picture?")],
        [_user("Two pictures.", images[2], "Compare it with", images[0], "this one.")],
        # long enough that every row is within twice another's length (the group's rule),
        # SmolVLM's two images (111 tokens) included
        _chat("What is a cache? Tell me about keys, values, offsets and trims, in a few words."),
        _chat("Say a lot about windows and state, please. " * 2),
    ]
    want = [_alone(loaded, prompt) for prompt in prompts]
    got = _first_jobs_queued_then_run(runner, prompts, [OPTIONS] * len(prompts))
    _assert_same_answers(got, want)
    assert len({(tuple(t), tuple(p)) for t, p in want}) == len(want), "it tells them apart"
    assert len(passes) == 1, passes
    cached, fed_images = passes[0]
    assert len(cached) == len(prompts) and cached[-1] > 0, "every row, the second turn's cached"
    assert fed_images, "the prompts with images were in the pass"


@pytest.mark.parametrize("row", ["image", "text"])
@pytest.mark.parametrize("leaves", ["cancelled", "closed"])
def test_a_row_that_ends_in_the_batch_leaves_the_others_exact(
    loaded, images, passes, monkeypatch, leaves, row
):
    """Of a prompt with an image and three text prompts fed together, one (`row`) is
    cancelled inside the batched pass (its cancel set there), or its client closes the stream
    after three tokens (decoding in the batch by then); the others answer as alone, nothing
    stays in use, and asked again it answers as a fresh Runner."""
    prompts = [[_user("Look:", images[1], "what is in this picture?")]]
    prompts += [_chat(q) for q in QUESTIONS[:3]]
    leaver = 0 if row == "image" else 1
    want = [_alone(loaded, prompt) for prompt in prompts]
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
    options = [dict(OPTIONS) for _ in prompts]
    options[leaver]["cancel"] = mine
    got = _first_jobs_queued_then_run(runner, prompts, options)
    assert ends == [leaves], ends
    assert passes == [(passes[0][0], True)] and len(passes[0][0]) == len(prompts), passes
    others = [i for i in range(len(prompts)) if i != leaver]
    _assert_same_answers([got[i] for i in others], [want[i] for i in others])
    wait_until(lambda: not runner._pool._in_use, what="every entry released")
    assert runner._dispatch._batching.batch.num_rows == 0
    again = _tokens_and_logprobs(stream(prompts[leaver], batched=True, **OPTIONS))
    _assert_same_answers([again], [want[leaver]])
