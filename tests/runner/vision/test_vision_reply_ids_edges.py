"""Review of ecb3d96 (a reply holding vision ids is sent back with its generated ids): other
vision ids than the image token's in the reply (the video token, a vision start followed by
the image token, several image tokens in a row, Gemma 3's start of image), an image after the
reply. Reference: a fresh Runner's prefill of the same record (the id is text there too);
the entry invariants (tests/invariants.py) after each request."""

from __future__ import annotations

import itertools

import mlx.core as mx
import pytest

pytest.importorskip("mlx_vlm")

from mlxkv import Runner  # noqa: E402
from mlxkv.decoding.sampling import SamplingParams  # noqa: E402
from mlxkv.models.vision import PLACEHOLDER_BASE  # noqa: E402
from mlxkv.testing.vision_factory import noise_images  # noqa: E402
from tests.runner.vision.test_vision_replies import _user  # noqa: E402
from tests.tolerances import LOGPROB_ABS  # noqa: E402

REPLY_TOKENS = 12


@pytest.fixture(scope="module")
def images():
    return noise_images(5, [(56, 56, 3), (84, 56, 3)])


def _forcing(monkeypatch, forced: dict[int, int]) -> None:
    """The reply's token number `at` (0-based) is `forced[at]`."""
    made = SamplingParams.make_logits_processors

    def with_forcing(params, *args, **kwargs):
        picks = itertools.count()

        def force(history, logits):
            at = next(picks)
            if at not in forced:
                return logits
            return mx.where(mx.arange(logits.shape[-1]) == forced[at], 0.0, -mx.inf)[None]

        return [*made(params, *args, **kwargs), force]

    monkeypatch.setattr(SamplingParams, "make_logits_processors", with_forcing)


def _greedy(runner: Runner, messages: list[dict]):
    chunks = list(runner.stream(messages, max_tokens=REPLY_TOKENS, temperature=0.0, logprobs=0))
    completion = chunks[-1].completion
    completion.__dict__["logprobs"] = [c.logprob.logprob for c in chunks[:-1] if c.logprob]
    return completion


def _ids(loaded, kind: str) -> list[int] | None:
    config = loaded.vision.family.vlm.config
    image = loaded.vision.image_token_id
    start = getattr(config, "vision_start_token_id", None)
    video = getattr(config, "video_token_id", None)
    family = loaded.vision.family
    tokenizer = family.processor.tokenizer
    marker = tokenizer.convert_tokens_to_ids(family.marker)  # Gemma 3: <start_of_image>
    fake = getattr(family.processor, "fake_image_token", None)  # Idefics3's around an image
    fake = None if fake is None else tokenizer.convert_tokens_to_ids(str(fake))
    return {
        "video": None if video is None else [video],
        "start_image": None if start is None else [start, image],
        "start_video": None if start is None or video is None else [start, video],
        "three_images": [image, image, image],
        "marker_image": [marker, image, image],
        "fake_image_fake": None if fake is None else [fake, image, fake],
        "start_last": None if start is None else [start],
    }[kind]


KINDS = [
    "video",
    "start_image",
    "start_video",
    "three_images",
    "marker_image",
    "fake_image_fake",
    "start_last",
]


@pytest.mark.parametrize("kind", KINDS)
def test_a_reply_holding_vision_ids_answers_as_a_fresh_prefill(loaded, images, monkeypatch, kind):
    forced_ids = _ids(loaded, kind)
    if forced_ids is None:
        pytest.skip(f"{kind}: no such id in this family")
    first_at = REPLY_TOKENS - len(forced_ids) if kind == "start_last" else 2
    forced = {first_at + i: t for i, t in enumerate(forced_ids)}
    runner = Runner(loaded, speculative=None)
    turn1 = [_user("Describe it.", images[0])]
    with monkeypatch.context() as patch:
        _forcing(patch, forced)
        first = _greedy(runner, turn1)
    assert [first.tokens[i] for i in forced] == forced_ids
    turn2 = turn1 + [
        {"role": "assistant", "content": first.text},
        _user("And this one?", images[1]),
    ]
    record = runner.encode(turn2)
    image_tokens = sum(loaded.vision.family.process(image).num_features for image in images)
    assert sum(t >= PLACEHOLDER_BASE for t in record) == image_tokens
    second = _greedy(runner, turn2)
    fresh = _greedy(Runner(loaded, speculative=None), turn2)
    assert fresh.cached_tokens == 0
    assert second.tokens == fresh.tokens
    assert second.logprobs == pytest.approx(fresh.logprobs, abs=LOGPROB_ABS)
    turn3 = turn2 + [
        {"role": "assistant", "content": second.text},
        _user("And the first again?", images[0]),
    ]
    third = _greedy(runner, turn3)
    fresh3 = _greedy(Runner(loaded, speculative=None), turn3)
    assert third.tokens == fresh3.tokens
    assert third.logprobs == pytest.approx(fresh3.logprobs, abs=LOGPROB_ABS)


@pytest.mark.parametrize("kind", ["three_images", "marker_image", "start_image"])
def test_a_reply_holding_vision_ids_sent_back_in_another_domain(loaded, images, monkeypatch, kind):
    """Another isolation domain renders the reply from its text: the vision ids' text must
    not become images' tokens (a count mismatch with the images given)."""
    forced_ids = _ids(loaded, kind)
    if forced_ids is None:
        pytest.skip(f"{kind}: no such id in this family")
    runner = Runner(loaded, speculative=None)
    turn1 = [_user("Describe it.", images[0])]
    with monkeypatch.context() as patch:
        _forcing(patch, {2 + i: t for i, t in enumerate(forced_ids)})
        first = _greedy(runner, turn1)
    turn2 = turn1 + [
        {"role": "assistant", "content": first.text},
        _user("And this one?", images[1]),
    ]
    chunks = list(
        runner.stream(turn2, max_tokens=REPLY_TOKENS, temperature=0.0, cache_salt="other")
    )
    fresh = Runner(loaded, speculative=None).generate(
        turn2, max_tokens=REPLY_TOKENS, temperature=0.0, cache_salt="other"
    )
    assert chunks[-1].completion.tokens == fresh.tokens
