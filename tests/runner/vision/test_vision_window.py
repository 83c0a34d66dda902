"""A conversation with images longer than the window: cut at message boundaries (whole oldest
messages after the system prompt; an image is never split), answered as a fresh Runner answers
the cut conversation; a last message that cannot fit alone is refused."""

from __future__ import annotations

import logging
import re

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm")


from mlxkv import Runner  # noqa: E402
from mlxkv.cli.common import setup_logging  # noqa: E402
from mlxkv.decoding.drafts import Draft  # noqa: E402
from mlxkv.errors import ContextLengthError  # noqa: E402
from mlxkv.runner import request_run  # noqa: E402
from mlxkv.runner.hooks import request_ends  # noqa: E402
from mlxkv.testing.vision_factory import noise_image  # noqa: E402
from tests.runner.test_multiturn_drafting import _IntermittentDrafter  # noqa: E402
from tests.tolerances import LOGPROB_ABS  # noqa: E402

MAX_TOKENS = 6
_LONG = "Describe the picture: the quick brown fox jumps over the lazy dog. " * 16


def _conversation() -> list[dict]:
    """System, a long first turn about image A, a turn about image B, a short question."""
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image", "image": noise_image(1)}, _text(_LONG * 2)]},
        {"role": "assistant", "content": "A fox."},
        {
            "role": "user",
            "content": [{"type": "image", "image": noise_image(2)}, _text("And this?")],
        },
        {"role": "assistant", "content": "A dog."},
        {"role": "user", "content": "Which was first?"},
    ]


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


def _greedy(runner: Runner, messages: list[dict]):
    chunks = list(runner.stream(messages, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0))
    completion = chunks[-1].completion
    completion.__dict__["first_logprob"] = chunks[0].logprob.logprob
    return completion


def test_a_conversation_over_the_window_drops_whole_oldest_messages(loaded, caplog):
    messages = _conversation()
    fresh = Runner(loaded)
    full = len(fresh.encode(messages))
    from_image_b = messages[:1] + messages[3:]
    kept = len(fresh.encode(from_image_b))
    window = 2 * kept + MAX_TOKENS + 2  # the cut at image B fits half the budget
    assert full > window, "the test's first turn must not fit"
    runner = Runner(loaded, max_context=window)
    with caplog.at_level(logging.INFO, logger="mlxkv.runner.request_builder"):
        got = _greedy(runner, messages)
    line = next(r.getMessage() for r in caplog.records if "prompt with images cut" in r.message)
    assert int(re.search(r"cut at message (\d+)", line).group(1)) == 3, line
    want = _greedy(fresh, from_image_b)
    assert got.prompt_tokens == kept
    assert got.tokens == want.tokens
    assert got.first_logprob == pytest.approx(want.first_logprob, abs=LOGPROB_ABS)


def test_the_next_turn_of_a_cut_conversation_reuses_it(loaded):
    messages = _conversation()
    kept = len(Runner(loaded).encode(messages[:1] + messages[3:]))
    runner = Runner(loaded, max_context=2 * kept + MAX_TOKENS + 2)
    first = _greedy(runner, messages)
    turn2 = messages + [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "Sure?"},
    ]
    second = _greedy(runner, turn2)
    assert second.cached_tokens >= 0.8 * kept  # the same cut: image B and after, reused
    want = _greedy(Runner(loaded), turn2[:1] + turn2[3:])
    assert second.tokens == want.tokens


def test_a_last_message_longer_than_the_window_is_refused(loaded):
    messages = [
        {"role": "user", "content": [{"type": "image", "image": noise_image(1)}, _text(_LONG)]}
    ]
    runner = Runner(loaded, max_context=64)
    with pytest.raises(ContextLengthError, match="last user message"):
        runner.generate(messages, max_tokens=4)


# A reply that reaches the window: its prompt cut at message boundaries mid-reply.
ROOM = 6  # reply tokens the window holds after the whole conversation
AFTER = 10  # reply tokens asked for past that


def _reply(runner: Runner, messages: list[dict], **options):
    """The completion, with each token's log-probability as `logprobs`."""
    chunks = runner.stream(
        messages, max_tokens=ROOM + AFTER, temperature=0.0, logprobs=0, **options
    )
    chunks = list(chunks)
    completion = chunks[-1].completion
    completion.__dict__["logprobs"] = [c.logprob.logprob for c in chunks if c.logprob]
    return completion


def _reply_cut(records) -> tuple[int, int]:
    """The message the reply's cut kept from and how many reply tokens it fed again, from the
    log line."""
    line = next(r.getMessage() for r in records if "reply with images reached" in r.message)
    first = int(re.search(r"cut at message (\d+)", line).group(1))
    return first, int(re.search(r"the reply's (\d+) tokens", line).group(1))


def _teacher_forced(loaded, messages: list[dict], image, reply: list[int]) -> list[float]:
    """mlx-vlm's own processor and model, no cache, one pass over the prompt and `reply`:
    each reply token's log-probability after the prompt and the reply before it."""
    vlm, processor = loaded.vision.vlm, loaded.vision.processor
    bare = [{**m, "content": _without_pixels(m["content"])} for m in messages]
    text = processor.tokenizer.apply_chat_template(bare, add_generation_prompt=True, tokenize=False)
    inputs = {k: mx.array(np.asarray(v)) for k, v in processor(images=[image], text=[text]).items()}
    ids = np.asarray(inputs.pop("input_ids")).tolist()[0]
    pixels = inputs.pop("pixel_values").astype(mx.float32)
    mask = inputs.pop("attention_mask")
    run = mx.array([ids + reply[:-1]])
    mask = mx.ones(run.shape, dtype=mask.dtype)
    embedded = vlm.get_input_embeddings(run, pixels, mask=mask, **inputs)
    extra = {k: v for k, v in embedded.to_dict().items() if v is not None}
    logits = vlm.language_model(run, inputs_embeds=extra.pop("inputs_embeds"), **extra).logits
    rows = logits[0, len(ids) - 1 :].astype(mx.float32)
    logprobs = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
    return [float(logprobs[j, token]) for j, token in enumerate(reply)]


def _without_pixels(content):
    if isinstance(content, str):
        return content
    return [{k: v for k, v in part.items() if k != "image"} for part in content]


def test_a_reply_past_the_window_cuts_whole_messages_and_goes_on(loaded, caplog):
    messages = _conversation()
    full = len(Runner(loaded).encode(messages))
    runner = Runner(loaded, max_context=full + ROOM)
    ends = []
    with caplog.at_level(logging.INFO), request_ends(ends.append):
        got = _reply(runner, messages)
    assert got.finish_reason == "length"
    assert len(got.tokens) == ROOM + AFTER > runner.max_context - full
    first, fed_again = _reply_cut(caplog.records)
    assert first == 3, "the cut keeps image B's turn and after (half the room)"
    cut = messages[:1] + messages[first:]
    # the entry holds the cut conversation and the whole reply, and its next turn cuts there
    (end,) = ends
    assert end.prompt == Runner(loaded).encode(cut)
    assert (
        end.entry.cache.tokens[: len(end.prompt) + fed_again] == end.prompt + got.tokens[:fed_again]
    )
    assert end.entry.cut_start == messages[first]
    # after the cut, each token's log-probability is the one the cut conversation and the reply
    # before it give, on mlx-vlm's own model without a cache
    want = _teacher_forced(loaded, cut, noise_image(2), got.tokens)
    after = slice(fed_again + 1, None)  # token fed_again was drawn before the cut
    assert got.logprobs[after] == pytest.approx(want[after], abs=1e-3)


@pytest.mark.parametrize("where", ["prompt", "reply"])
def test_a_cut_is_said_on_the_console_without_verbose_once_and_alone(loaded, capsys, where):
    """The CLI's logging (`setup_logging`, no --verbose): an image cut, before the reply or
    mid-reply, is the one line its request shows (as a text chat's cut is); the cache's own
    lines stay quiet."""
    messages = _conversation()
    if where == "prompt":  # as the first test cuts it
        kept = len(Runner(loaded).encode(messages[:1] + messages[3:]))
        window, said = 2 * kept + MAX_TOKENS + 2, "prompt with images cut"
    else:  # as the reply tests cut it
        window, said = len(Runner(loaded).encode(messages)) + ROOM, "reply with images reached"
    runner = Runner(loaded, max_context=window)
    capsys.readouterr()
    setup_logging(verbose=False)
    _reply(runner, messages)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and said in lines[0], lines


def test_the_next_turn_after_a_reply_cut_reuses_it(loaded):
    messages = _conversation()
    full = len(Runner(loaded).encode(messages))
    runner = Runner(loaded, max_context=full + ROOM)
    reply = _reply(runner, messages)
    turn2 = messages + [
        {"role": "assistant", "content": reply.text},
        {"role": "user", "content": "Sure?"},
    ]
    second = _greedy(runner, turn2)
    kept = len(Runner(loaded).encode(messages[:1] + messages[3:]))
    assert second.cached_tokens >= kept  # the cut conversation and the reply's start, reused
    want = _greedy(Runner(loaded), turn2[:1] + turn2[3:])
    assert second.tokens == want.tokens
    assert second.first_logprob == pytest.approx(want.first_logprob, abs=LOGPROB_ABS)


def test_overflow_stop_still_stops_a_reply_with_images_at_the_window(loaded):
    messages = _conversation()
    full = len(Runner(loaded).encode(messages))
    got = _reply(Runner(loaded, max_context=full + ROOM), messages, overflow="stop")
    assert got.finish_reason == "length"
    assert len(got.tokens) == ROOM


def test_a_reply_with_no_message_to_drop_stops_at_the_window(loaded, caplog):
    messages = [
        {"role": "user", "content": [{"type": "image", "image": noise_image(1)}, _text("Hi")]}
    ]
    full = len(Runner(loaded).encode(messages))
    with caplog.at_level(logging.INFO, logger="mlxkv.runner.request_builder"):
        got = _reply(Runner(loaded, max_context=full + ROOM), messages)
    assert got.finish_reason == "length"
    assert len(got.tokens) == ROOM
    assert any("no whole message to drop" in r.getMessage() for r in caplog.records)


def _short_conversation(runner: Runner) -> list[dict]:
    """`_conversation` with its first user message just long enough that the reply's first
    cut (at image B) leaves room for a second one within a short reply."""
    kept = len(runner.encode(_conversation()[:1] + _conversation()[3:]))
    for words in range(1, 400, 4):  # bounded: the first user message grows 4 words a step
        messages = _conversation()
        messages[1]["content"][1] = _text(" ".join(["fox"] * words))
        if len(runner.encode(messages)) >= 2 * kept + 2:
            return messages
    raise AssertionError("no first message long enough")


def test_a_long_reply_cuts_again_later_and_stops_where_no_message_is_left(loaded, caplog):
    messages = _short_conversation(Runner(loaded))
    full = len(Runner(loaded).encode(messages))
    runner = Runner(loaded, max_context=full + ROOM)
    with caplog.at_level(logging.INFO):
        chunks = list(runner.stream(messages, max_tokens=2 * runner.max_context, temperature=0.0))
    got = chunks[-1].completion
    lines = [r.getMessage() for r in caplog.records]
    cuts = [int(re.search(r"cut at message (\d+)", x).group(1)) for x in lines if "reached" in x]
    assert cuts == [3, 5], "each cut goes past the one before"
    assert any("stopped at the window" in line for line in lines)
    assert got.finish_reason == "length"
    assert runner.max_context - full < len(got.tokens) < runner.max_context


class _ReplyDrafter:
    """Drafts the rest of the reference reply at every position: passes as long as the
    drafted length allows, so one reaches the window wherever it may."""

    def __init__(self, prompt, reply):
        self._text, self._whole = list(prompt), list(prompt) + list(reply)

    def extend(self, tokens):
        self._text.extend(tokens)

    def can_propose(self):
        return len(self._text) < len(self._whole)

    def propose(self, limit):
        return Draft(self._whole[len(self._text) : len(self._text) + limit])


@pytest.mark.parametrize("drafter", [_IntermittentDrafter, _ReplyDrafter])
def test_a_reply_decoded_with_drafts_cuts_at_the_window_as_a_plain_one(
    loaded, monkeypatch, drafter
):
    """Drafts verified up to the cut a reply makes at the window (the model rebound to the
    cut prompt mid-reply), and after it, give plain decoding's reply: the cut comes at the
    same token (a pass that would reach past the window drafts less)."""
    messages = _conversation()
    full = len(Runner(loaded).encode(messages))
    want = _reply(Runner(loaded, max_context=full + ROOM, speculative=None), messages)
    reply = [*want.tokens, *loaded.tokenizer.eos_token_ids][: ROOM + AFTER + 1]
    monkeypatch.setattr(
        request_run, "NgramDrafter", lambda prompt, vocab_size: drafter(prompt, reply)
    )
    got = _reply(Runner(loaded, max_context=full + ROOM), messages, speculative="ngram")
    assert got.tokens == want.tokens
    assert got.logprobs == pytest.approx(want.logprobs, abs=LOGPROB_ABS)
    assert got.drafted_tokens > 0
