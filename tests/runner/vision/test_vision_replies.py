"""A reply sent back in a prompt with images takes the ids the model generated (the reply
memory, `mlxkv.runner.text.replies`), as a text prompt's does, on a tiny random model of every
family: the next turn reuses the whole first turn where the reply's text encodes otherwise, an
image after the reply gets its place in the ids fed, and another isolation domain renders the
reply from its text.

The reference for the answers is mlx-vlm's own model, no cache, fed the same ids (the Runner's
token record, each placeholder as the image token id) with mlx-vlm's processor's pixels, and
computing their positions itself (`get_rope_index`). A fresh Runner is no reference here: the
reply memory belongs to the loaded model, so it takes the same ids. The record itself is
checked against mlx-vlm's processor on the messages' text: the same text once decoded, the
reply's generated ids where the processor has its text's, the same images' tokens.
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import pytest

pytest.importorskip("mlx_vlm")

from mlxkv import Runner  # noqa: E402
from mlxkv.decoding.sampling import SamplingParams  # noqa: E402
from mlxkv.models.vision import PLACEHOLDER_BASE  # noqa: E402
from mlxkv.testing.vision_factory import noise_images  # noqa: E402
from tests.runner.vision.test_vision import _processed, _reference_steps  # noqa: E402
from tests.tolerances import LOGPROB_ABS  # noqa: E402

# Templates that write a reply sent back right after the generation prompt of its turn, so
# that the next turn can reuse the whole first one; SmolVLM's and Idefics3's write a space
# between "Assistant:" and the reply, where the model generated its first token instead (a
# first token that holds that space is reused in full: the last test).
WHOLE_TURN = {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "gemma3"}
# Long enough that the random model's reply encodes otherwise in every family (asserted).
REPLY_TOKENS = 12
QUESTION = "Describe it."


@pytest.fixture(scope="module")
def images():
    return noise_images(5, [(56, 56, 3), (84, 56, 3)])


def _user(text: str, image=None) -> dict:
    parts = [{"type": "text", "text": text}]
    return {
        "role": "user",
        "content": parts if image is None else [{"type": "image", "image": image}, *parts],
    }


def _greedy(runner: Runner, messages: list[dict], **options):
    """The completion, with every token's log-probability as `logprobs`."""
    chunks = list(
        runner.stream(messages, max_tokens=REPLY_TOKENS, temperature=0.0, logprobs=0, **options)
    )
    completion = chunks[-1].completion
    completion.__dict__["logprobs"] = [c.logprob.logprob for c in chunks[:-1] if c.logprob]
    return completion


def _mapped(loaded, record: list[int]) -> list[int]:
    """The record as mlx-vlm's processor writes it: each placeholder the image token id."""
    image_token = loaded.vision.image_token_id
    return [image_token if t >= PLACEHOLDER_BASE else t for t in record]


def _first_turn(loaded, images, **options):
    runner = Runner(loaded)
    turn1 = [_user(QUESTION, images[0])]
    return runner, turn1, _greedy(runner, turn1, **options)


def _check_record(loaded, record, turn2, pictures, first) -> int:
    """The record is the processor's ids with the reply's text as the ids generated, which
    encode otherwise here (the point of the test); returns where the reply's ids begin. (The
    ids are compared, not their decoded text: mlx-lm's detokenizer drops a reply's leading
    space, which the ids keep.)"""
    processor_ids, _ = _processed(loaded, turn2, pictures)
    mapped = _mapped(loaded, record)
    assert mapped != processor_ids, "the reply encodes as generated: nothing checked"
    n = len(first.tokens)
    at = next((i for i in range(len(record)) if record[i : i + n] == first.tokens), None)
    assert at is not None, "the reply's generated ids are not in the record"
    after = len(record) - at - len(first.tokens)
    assert mapped[:at] == processor_ids[:at]
    assert mapped[len(mapped) - after :] == processor_ids[len(processor_ids) - after :]
    return at


def _check_reuse(loaded, runner, turn1, first, record, at, got) -> None:
    """`got` (the next turn) reused all its record shares with what the first turn left in
    the cache: the whole first turn where the template allows (`WHOLE_TURN`)."""
    held = runner.encode(turn1) + first.tokens[:-1]  # the last reply token was never fed
    pairs = enumerate(zip(held, record, strict=False))
    shared = next((i for i, (a, b) in pairs if a != b), min(len(held), len(record)))
    assert got.cached_tokens >= shared
    if loaded.path.name in WHOLE_TURN:
        assert at == first.prompt_tokens
        assert shared == first.prompt_tokens + len(first.tokens) - 1


def _answers_as_mlx_vlm(loaded, got, turn2, pictures, record) -> None:
    want_tokens, want_logprobs = _reference_steps(loaded, turn2, pictures, record, REPLY_TOKENS)
    assert got.tokens == want_tokens[: len(got.tokens)]
    assert got.logprobs == pytest.approx(want_logprobs[: len(got.logprobs)], abs=1e-3)


def test_next_turn_reuses_a_reply_that_encodes_otherwise_and_answers_as_mlx_vlm(loaded, images):
    runner, turn1, first = _first_turn(loaded, images)
    turn2 = turn1 + [{"role": "assistant", "content": first.text}, _user("And the colors?")]
    record = runner.encode(turn2)
    at = _check_record(loaded, record, turn2, [images[0]], first)
    runs = loaded.vision.encoder_runs
    second = _greedy(runner, turn2)
    _check_reuse(loaded, runner, turn1, first, record, at, second)
    assert loaded.vision.encoder_runs == runs
    assert second.prompt_tokens == len(record)
    _answers_as_mlx_vlm(loaded, second, turn2, [images[0]], record)


@pytest.mark.parametrize("first_image", [True, False], ids=["image-then-image", "text-then-image"])
def test_an_image_after_the_reply_takes_its_place_in_the_ids_fed(loaded, images, first_image):
    """The reply's ids are fewer or more than its text's, so the image after it sits elsewhere
    than in the processor's ids: its tokens, and (M-RoPE) its positions and those after it,
    follow. The first turn holds an image, or is text (an agent's screenshot pasted later)."""
    runner = Runner(loaded)
    turn1 = [_user(QUESTION, images[0] if first_image else None)]
    first = _greedy(runner, turn1)
    turn2 = turn1 + [
        {"role": "assistant", "content": first.text},
        _user("And this one?", images[1]),
    ]
    pictures = images if first_image else [images[1]]
    record = runner.encode(turn2)
    at = _check_record(loaded, record, turn2, pictures, first)
    processor_ids, _ = _processed(loaded, turn2, pictures)
    assert len(record) != len(processor_ids), "the reply's length did not change: not checked"
    second = _greedy(runner, turn2)
    _check_reuse(loaded, runner, turn1, first, record, at, second)
    _answers_as_mlx_vlm(loaded, second, turn2, pictures, record)
    # the turn after that reuses the image after the first reply, and the second reply
    turn3 = turn2 + [{"role": "assistant", "content": second.text}, _user("Compare them.")]
    third, record3 = _greedy(runner, turn3), runner.encode(turn3)
    assert third.cached_tokens >= second.prompt_tokens
    _answers_as_mlx_vlm(loaded, third, turn3, pictures, record3)


def _forcing(monkeypatch, token: int, at: int) -> None:
    """Each request's logits processors end with one that makes `token` its reply's token
    number `at` (0-based): as a random model now and then emits the image token's id."""
    made = SamplingParams.make_logits_processors

    def with_forcing(params, *args, **kwargs):
        picks = itertools.count()

        def force(history, logits):
            if next(picks) != at:
                return logits
            return mx.where(mx.arange(logits.shape[-1]) == token, 0.0, -mx.inf)[None]

        return [*made(params, *args, **kwargs), force]

    monkeypatch.setattr(SamplingParams, "make_logits_processors", with_forcing)


def test_a_reply_holding_the_image_tokens_id_takes_its_ids(loaded, images, monkeypatch):
    """The model generated the image token's id in its reply (text it read as text, at text
    positions): sent back, the reply takes its ids and the id stays text, an image after it
    included (M-RoPE: `get_rope_index` would take the id for that image's). The next turn
    reuses the whole first turn and answers as a fresh Runner's prefill of the same record."""
    image_token = loaded.vision.image_token_id
    runner = Runner(loaded, speculative=None)
    turn1 = [_user(QUESTION, images[0])]
    with monkeypatch.context() as forced:
        _forcing(forced, image_token, at=2)
        first = _greedy(runner, turn1)
    assert first.tokens[2] == image_token
    turn2 = turn1 + [
        {"role": "assistant", "content": first.text},
        _user("And this one?", images[1]),
    ]
    record = runner.encode(turn2)
    n = len(first.tokens)
    at = next((i for i in range(len(record)) if record[i : i + n] == first.tokens), None)
    assert at is not None, "the reply rendered from its text"
    image_tokens = sum(loaded.vision.family.process(image).num_features for image in images)
    assert sum(t >= PLACEHOLDER_BASE for t in record) == image_tokens
    second = _greedy(runner, turn2)
    _check_reuse(loaded, runner, turn1, first, record, at, second)
    fresh = _greedy(Runner(loaded, speculative=None), turn2)
    assert fresh.cached_tokens == 0
    assert second.tokens == fresh.tokens
    assert second.logprobs == pytest.approx(fresh.logprobs, abs=LOGPROB_ABS)


def test_another_isolation_domain_renders_the_reply_from_its_text(loaded, images):
    runner, turn1, first = _first_turn(loaded, images, cache_salt="tenant-a")
    turn2 = turn1 + [{"role": "assistant", "content": first.text}, _user("And the colors?")]
    theirs = runner.encode(turn2, cache_salt="tenant-b")
    ours = runner.encode(turn2, cache_salt="tenant-a")
    _check_record(loaded, ours, turn2, [images[0]], first)
    n = len(first.tokens)
    assert all(theirs[i : i + n] != first.tokens for i in range(len(theirs)))


def test_a_reply_sent_back_as_text_parts_takes_its_ids_too(loaded, images):
    runner, turn1, first = _first_turn(loaded, images)
    as_text = turn1 + [{"role": "assistant", "content": first.text}, _user("And the colors?")]
    parts = [{"type": "text", "text": first.text}]
    as_parts = turn1 + [{"role": "assistant", "content": parts}, _user("And the colors?")]
    record = runner.encode(as_parts)
    assert record == runner.encode(as_text)
    _check_record(loaded, record, as_text, [images[0]], first)


def test_a_template_that_rewrites_the_reply_renders_it_from_its_text(loaded, images, monkeypatch):
    """As a text prompt's: a reply the template does not write as given (here cut to its first
    characters) cannot take its ids, so the whole prompt renders from text."""
    runner, turn1, first = _first_turn(loaded, images)
    turn2 = turn1 + [{"role": "assistant", "content": first.text}, _user("And the colors?")]
    tokenizer = loaded.tokenizer
    render = tokenizer.apply_chat_template

    def rewriting(messages, **options):
        cut = [
            {**m, "content": m["content"][:5]} if m["role"] == "assistant" else m for m in messages
        ]
        return render(cut, **options)

    monkeypatch.setattr(tokenizer, "apply_chat_template", rewriting, raising=False)
    # control-token text parsed: content escaped as plain text must be written as given too
    parsed = {"parse_control_tokens": True}
    record = runner.encode(turn2, **parsed)
    assert record == runner.encode(turn2, cache_salt="no reply of its own", **parsed)
    n = len(first.tokens)
    assert all(record[i : i + n] != first.tokens for i in range(len(record)))
    second = _greedy(runner, turn2, **parsed)
    assert second.prompt_tokens == len(record)


def test_a_reply_that_begins_with_a_spaced_token_is_reused_in_full(loaded, images):
    """A reply whose first token holds a space, as a trained model's often does (the text sent
    back lacks it: the detokenizer drops it): SmolVLM's and Idefics3's templates write their
    own space after "Assistant:", which the ids already hold (`text.replies.before_reply`),
    so every family reuses the whole first turn. (The random model: such a reply is found
    among a few questions, not assumed.)"""
    runner, tokenizer = Runner(loaded), loaded.tokenizer
    for i in range(20):
        turn1 = [_user(f"Tell me {i} things.", images[0])]
        first = runner.generate(turn1, max_tokens=6, temperature=0.0)
        lead = tokenizer.decode(first.tokens[:1])
        if lead.startswith(" ") and lead.strip() and not first.text.startswith(" "):
            break
    else:
        raise AssertionError("no reply of the first 20 questions began with a spaced token")
    held = runner.encode(turn1) + first.tokens[:-1]  # the last reply token was never fed
    turn2 = turn1 + [{"role": "assistant", "content": first.text}, _user("More.")]
    assert runner.encode(turn2)[: len(held)] == held
    assert runner.generate(turn2, max_tokens=2, temperature=0.0).cached_tokens >= len(held)
