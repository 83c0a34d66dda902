"""Images in chat messages on a tiny random model of each family (Qwen2-VL, Qwen2.5-VL,
Gemma 3, SmolVLM with its tiles): answers equal
mlx-vlm's own model run without a cache, a conversation's next turn reuses the image's K/V (no
encoder run, no prefill of its tokens), a different image at the same place stops the match
before its first token."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm")

from PIL import Image  # noqa: E402

from mlxkv import Runner  # noqa: E402
from mlxkv.config import ENCODER_CACHE_FRACTION  # noqa: E402
from mlxkv.models.loading import load_model  # noqa: E402
from mlxkv.models.vision import PLACEHOLDER_BASE  # noqa: E402
from mlxkv.runner import request_run  # noqa: E402
from mlxkv.testing.vision_factory import build_vision_model, noise_images  # noqa: E402
from tests.runner.test_multiturn_drafting import _IntermittentDrafter  # noqa: E402
from tests.tolerances import LOGPROB_ABS  # noqa: E402

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def images():
    return noise_images(0, [(56, 56, 3)] * 2)


def _ask(image, text: str = "What is this?") -> list[dict]:
    return [
        {
            "role": "user",
            "content": [{"type": "image", "image": image}, {"type": "text", "text": text}],
        }
    ]


def _greedy(runner: Runner, messages: list[dict]):
    """The completion, with the first token's log-probability as `first_logprob`."""
    chunks = list(runner.stream(messages, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0))
    completion = chunks[-1].completion
    completion.__dict__["first_logprob"] = chunks[0].logprob.logprob
    return completion


def _reference(
    loaded, messages: list[dict], image, record=None, max_tokens: int = MAX_TOKENS
) -> tuple[list[int], float]:
    """mlx-vlm's own processor and model as its `generate` calls them, no cache: the whole
    sequence each step; the greedy tokens and the first one's log-probability.

    `image`: one image or a list, in the prompt's order. `record`: the ids to feed in place of
    the processor's (a Runner's token record, `Runner.encode`, each image placeholder as the
    image token id), with the processor's pixels; mlx-vlm's model computes the positions of
    those ids itself (`get_rope_index`)."""
    tokens, logprobs = _reference_steps(loaded, messages, image, record, max_tokens)
    return tokens, logprobs[0]


def _reference_steps(loaded, messages, image, record, max_tokens):
    """`_reference`'s greedy tokens and every step's log-probability of its token."""
    vlm = loaded.vision.vlm
    ids, inputs = _processed(loaded, messages, image)
    if record is not None:
        image_token = loaded.vision.image_token_id
        ids = [image_token if t >= PLACEHOLDER_BASE else t for t in record]
    pixels, mask = inputs.pop("pixel_values").astype(mx.float32), inputs.pop("attention_mask")
    tokens, logprobs = [], []
    for _ in range(max_tokens):
        run = mx.array([ids + tokens])
        mask = mx.ones(run.shape, dtype=mask.dtype)
        embedded = vlm.get_input_embeddings(run, pixels, mask=mask, **inputs)
        extra = {k: v for k, v in embedded.to_dict().items() if v is not None}
        embeds = extra.pop("inputs_embeds")
        logits = vlm.language_model(run, inputs_embeds=embeds, **extra).logits
        step = logits[0, -1] - mx.logsumexp(logits[0, -1])
        tokens.append(int(mx.argmax(step)))
        logprobs.append(float(step[tokens[-1]]))
    return tokens, logprobs


def _processed(loaded, messages: list[dict], image) -> tuple[list[int], dict]:
    """mlx-vlm's processor on the messages' text (through the chat template) and images: its
    ids, and its other inputs (pixels, grids, masks) as MLX arrays."""
    processor = loaded.vision.processor
    bare = [{**m, "content": _without_pixels(m["content"])} for m in messages]
    text = processor.tokenizer.apply_chat_template(bare, add_generation_prompt=True, tokenize=False)
    images = image if isinstance(image, list) else [image]
    inputs = {k: mx.array(np.asarray(v)) for k, v in processor(images=images, text=[text]).items()}
    return np.asarray(inputs.pop("input_ids")).tolist()[0], inputs


def _image_end(runner: Runner, messages: list[dict]) -> int:
    """The index after the prompt's last image token."""
    record = runner.encode(messages)
    return max(i for i, t in enumerate(record) if t >= PLACEHOLDER_BASE) + 1


def _without_pixels(content):
    if isinstance(content, str):
        return content
    return [{k: v for k, v in part.items() if k != "image"} for part in content]


def test_image_answers_equal_mlx_vlm_and_depend_on_the_image(loaded, images):
    runner = Runner(loaded)
    answers = []
    for image in images:
        completion = _greedy(runner, _ask(image))
        want_tokens, want_logprob = _reference(loaded, _ask(image), image)
        assert completion.tokens == want_tokens
        assert completion.first_logprob == pytest.approx(want_logprob, abs=1e-3)
        answers.append(completion.tokens)
    assert answers[0] != answers[1], "the tiny model must see the image"


def test_next_turn_reuses_the_image_without_encoding_or_prefilling_it(loaded, images):
    runner = Runner(loaded)
    question = "Describe the picture: the quick brown fox jumps over the lazy dog. " * 16
    first = _greedy(runner, _ask(images[0], question))
    runs = loaded.vision.encoder_runs
    turn2 = _ask(images[0], question) + [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And the colors?"},
    ]
    second = _greedy(runner, turn2)
    assert loaded.vision.encoder_runs == runs, "the image's tokens came from the cache"
    # the image and the question (a windowed model resumes at its last checkpoint before the
    # reply when the reply's text encodes otherwise)
    assert second.cached_tokens >= _image_end(runner, turn2)
    assert second.cached_tokens >= 0.9 * second.prompt_tokens
    fresh = _greedy(Runner(loaded), turn2)
    assert second.tokens == fresh.tokens
    assert second.first_logprob == pytest.approx(fresh.first_logprob, abs=LOGPROB_ABS)
    # mlx-vlm's model on the ids fed: the reply's generated ids where its text encodes otherwise
    want_tokens, want_logprob = _reference(loaded, turn2, images[0], runner.encode(turn2))
    assert second.tokens == want_tokens
    assert second.first_logprob == pytest.approx(want_logprob, abs=1e-3)


def test_other_image_at_the_same_place_stops_the_match_before_it(loaded, images):
    runner = Runner(loaded)
    _greedy(runner, _ask(images[0]))
    second = _greedy(runner, _ask(images[1]))
    record = runner.encode(_ask(images[1]))
    first_placeholder = next(i for i, t in enumerate(record) if t >= PLACEHOLDER_BASE)
    assert second.cached_tokens == first_placeholder
    # every run of the image's tokens (SmolVLM: one per tile) is keyed by its pixels
    other = runner.encode(_ask(images[0]))
    keyed = [(a, b) for a, b in zip(other, record, strict=True) if b >= PLACEHOLDER_BASE]
    assert keyed and all(a != b and a >= PLACEHOLDER_BASE for a, b in keyed)
    fresh = _greedy(Runner(loaded), _ask(images[1]))
    assert second.tokens == fresh.tokens


def test_an_image_sent_again_skips_the_encoder(loaded, images):
    image = Image.fromarray(np.full((56, 56, 3), 77, dtype=np.uint8))
    runner = Runner(loaded)
    runs = loaded.vision.encoder_runs
    _greedy(runner, _ask(image, "first conversation"))
    _greedy(runner, [{"role": "system", "content": "Be brief."}] + _ask(image, "second"))
    assert loaded.vision.encoder_runs == runs + 1


def test_a_placeholder_typed_by_the_user_stays_text(loaded, images):
    runner = Runner(loaded)
    family = loaded.vision.family
    typed = f"{family.marker} {loaded.tokenizer.convert_ids_to_tokens(family.image_token_id)}"
    record = runner.encode(_ask(images[0], typed))
    assert family.image_token_id not in record
    image_tokens = family.process(images[0]).num_features  # 4, or 20 in SmolVLM's 5 tiles
    assert sum(t >= PLACEHOLDER_BASE for t in record) == image_tokens
    _greedy(runner, _ask(images[0], typed))


def test_a_conversation_with_an_image_comes_back_from_disk_after_a_restart(
    loaded, images, tmp_path
):
    turn1 = _ask(images[0])
    before = Runner(loaded, cache_entries=4, cache_dir=tmp_path)
    first = _greedy(before, turn1)
    before.close()
    assert list(tmp_path.glob("*/*"))
    turn2 = turn1 + [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "Again?"},
    ]
    after = Runner(loaded, cache_entries=4, cache_dir=tmp_path)
    got = _greedy(after, turn2)
    assert got.cached_tokens >= _image_end(after, turn2)  # the image's tokens came from disk
    assert got.tokens == _greedy(Runner(loaded), turn2).tokens


def test_info_says_whether_a_model_takes_images(loaded, loaded_tiny):
    from mlxkv.models.inspect import describe

    assert describe(loaded)["images"].startswith("yes")
    assert describe(loaded)["architecture"] == loaded.path.name  # the family, e.g. gemma3
    assert describe(loaded_tiny("llama"))["images"] == "no (text only)"


def test_a_reply_with_an_image_stops_at_the_window_instead_of_shifting(loaded, images):
    window = len(Runner(loaded).encode(_ask(images[0]))) + 8
    runner = Runner(loaded, max_context=window)
    completion = runner.generate(_ask(images[0]), max_tokens=100, temperature=0.0)
    assert completion.finish_reason == "length"
    assert completion.prompt_tokens + completion.generation_tokens == window


def test_an_image_fed_over_several_calls_answers_as_in_one(loaded, images):
    """Prefill calls of 3 tokens split every image run (and SmolVLM's tiles, and Qwen3-VL's
    deepstack rows) between calls: the answer is mlx-vlm's on the whole sequence."""
    completion = _greedy(Runner(loaded, prefill_step_size=3), _ask(images[0]))
    want_tokens, want_logprob = _reference(loaded, _ask(images[0]), images[0])
    assert completion.tokens == want_tokens
    assert completion.first_logprob == pytest.approx(want_logprob, abs=1e-3)


@pytest.mark.parametrize("step", [None, 3], ids=["default-calls", "calls-of-3"])
@pytest.mark.parametrize("second", [1, 0], ids=["two-images", "same-image-twice"])
def test_two_images_in_one_message_answer_as_mlx_vlm(loaded, images, second, step):
    """Two images in one message, fed in the default prefill calls or in calls of 3 tokens
    (boundaries inside and between the images), past Gemma 3's 32-token window: every step's
    token and log-probability are mlx-vlm's on the whole sequence (its encoder runs both
    images in one batch, mlxkv's one at a time)."""
    pictures = [images[0], images[second]]
    messages = [
        {
            "role": "user",
            "content": [
                *({"type": "image", "image": picture} for picture in pictures),
                {"type": "text", "text": "What differs between them?"},
            ],
        }
    ]
    runner = Runner(loaded, prefill_step_size=step)
    chunks = list(runner.stream(messages, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0))
    want_tokens, want_logprobs = _reference_steps(loaded, messages, pictures, None, MAX_TOKENS)
    assert chunks[-1].completion.tokens == want_tokens
    got_logprobs = [c.logprob.logprob for c in chunks[:-1] if c.logprob]
    assert got_logprobs == pytest.approx(want_logprobs[: len(got_logprobs)], abs=1e-3)


def test_the_tiny_models_image_rows_carry_the_pixels(loaded, images):
    """The factory's encoder rows are far above float32 rounding and change with the image:
    with mlx-vlm's initial Gemma 3 projection (ones), every row summed a zero-mean vector, so
    rows were rounding noise of about 1e-6 that changed with the encoder's batch and the
    process, and a Runner's answers with two images differed from mlx-vlm's by that noise."""
    family = loaded.vision.family
    rows = [np.asarray(family.encode(family.process(image))[0]) for image in images]
    for each in rows:
        assert np.sqrt(np.mean(each**2)) > 1e-2
    assert np.abs(rows[0] - rows[1]).max() > 1e-2


def test_encoder_outputs_count_inside_the_byte_budget_and_show_in_the_memory_line(loaded, images):
    family = loaded.vision.family
    one = family.encode(family.process(images[0])).nbytes  # float32 rows, as the cache keeps
    cache_bytes = int(1.5 * one / ENCODER_CACHE_FRACTION)  # the encoder's share holds one image
    runner = Runner(loaded, cache_entries=4, cache_bytes=cache_bytes, max_context=256)
    runs = loaded.vision.encoder_runs
    _greedy(runner, _ask(images[0]))
    report = runner.cache_info()
    assert report.encoder_bytes == one
    kv_bytes = sum(entry.allocated_bytes + entry.draft_bytes for entry in report.entries)
    assert report.held_bytes == kv_bytes + one
    assert "image encoder outputs" in runner.memory_line
    _greedy(runner, _ask(images[1]))  # the first image's outputs make room for the second's
    assert runner.cache_info().encoder_bytes == one
    _greedy(runner, [{"role": "system", "content": "Again."}] + _ask(images[0]))
    assert loaded.vision.encoder_runs == runs + 3


def test_each_image_goes_through_the_processor_once_per_conversation(loaded, images, monkeypatch):
    family = loaded.vision.family
    calls = []
    process = family.process
    monkeypatch.setattr(family, "process", lambda image: calls.append(1) or process(image))
    runner = Runner(loaded)
    first = _greedy(runner, _ask(images[1], "a question of its own"))
    assert len(calls) == 1  # not again for the render without the generation prompt
    turn2 = _ask(images[1], "a question of its own") + [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And?"},
    ]
    _greedy(runner, turn2)
    assert len(calls) == 1


def test_a_reply_with_images_decoded_with_drafts_equals_plain_and_is_reused(
    loaded, images, monkeypatch
):
    """Drafts (accepted, one rejected and rolled back, plain decoding between) verified on the
    model bound to the prompt's images: the answer and log-probabilities of plain decoding,
    and a next turn that reuses and answers as plain decoding's."""
    messages = _ask(images[0], "Describe it in every detail, please.")
    options = {"max_tokens": 24, "temperature": 0.0, "logprobs": 0}
    plain = Runner(loaded, max_context=1024, speculative=None)
    want_chunks = list(plain.stream(messages, **options))
    want = want_chunks[-1].completion
    reply = [*want.tokens, *loaded.tokenizer.eos_token_ids][: options["max_tokens"] + 1]
    monkeypatch.setattr(
        request_run, "NgramDrafter", lambda prompt, vocab_size: _IntermittentDrafter(prompt, reply)
    )
    drafted = Runner(loaded, max_context=1024)
    chunks = list(drafted.stream(messages, speculative="ngram", **options))
    got = chunks[-1].completion
    assert got.tokens == want.tokens
    assert [c.logprob.logprob for c in chunks[:-1]] == pytest.approx(
        [c.logprob.logprob for c in want_chunks[:-1]], abs=LOGPROB_ABS
    )
    assert len(want.tokens) > 6, "too short a reply to draft in"
    assert got.drafted_tokens > got.accepted_tokens > 0
    turn2 = messages + [
        {"role": "assistant", "content": got.text},
        {"role": "user", "content": "And the colors?"},
    ]
    second, plain_second = _greedy(drafted, turn2), _greedy(plain, turn2)
    assert second.cached_tokens == plain_second.cached_tokens
    assert second.tokens == plain_second.tokens
    assert second.first_logprob == pytest.approx(plain_second.first_logprob, abs=LOGPROB_ABS)


def test_next_turn_with_an_image_reuses_a_reply_that_encodes_otherwise(tmp_path, images):
    loaded = load_model(build_vision_model(tmp_path / "vl", family="qwen2_5_vl"))
    runner = Runner(loaded)
    first = runner.generate(_ask(images[0]), max_tokens=MAX_TOKENS, temperature=0.0)
    encoded = loaded.tokenizer.encode(first.text, add_special_tokens=False)
    if encoded == first.tokens:
        pytest.skip("this reply encodes as generated: nothing to check")
    turn2 = _ask(images[0]) + [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And the colors?"},
    ]
    second = runner.generate(turn2, max_tokens=MAX_TOKENS, temperature=0.0)
    # a text prompt's next turn reuses its whole first turn here (the reply memory's ids)
    assert second.cached_tokens >= first.prompt_tokens + len(first.tokens) - 1
