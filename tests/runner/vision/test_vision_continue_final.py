"""A prompt with images continues its last assistant message (`CONTINUE_FINAL`: Anthropic's
prefill, OpenAI's `continue_final_message`) as a text prompt does, on a tiny random model of
each vision family: the token record is the one mlx-vlm's processor makes of the chat as
Hugging Face's `continue_final_message` renders it (the template's text cut right after that
message), and the reply is mlx-vlm's own model's on it, run without a cache."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mlx_vlm")

from mlxkv import Runner  # noqa: E402
from mlxkv.models.vision import PLACEHOLDER_BASE  # noqa: E402
from mlxkv.runner.text.chat import CONTINUE_FINAL  # noqa: E402
from mlxkv.testing.vision_factory import noise_images  # noqa: E402
from tests.runner.vision.test_vision import _ask, _reference, _without_pixels  # noqa: E402

CONTINUE = {CONTINUE_FINAL: True}
PREFILL = "The picture shows"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def image():
    return noise_images(3, [(56, 56, 3)])[0]


def _continued_ids(loaded, messages, image) -> list[int]:
    """mlx-vlm's processor's ids for the chat as Hugging Face continues its last message."""
    processor = loaded.vision.processor
    bare = [{**m, "content": _without_pixels(m["content"])} for m in messages]
    text = processor.tokenizer.apply_chat_template(
        bare, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert text.endswith(PREFILL)
    return np.asarray(processor(images=[image], text=[text])["input_ids"]).tolist()[0]


def test_the_reply_continues_the_last_assistant_message_as_mlx_vlm_does(loaded, image):
    messages = [*_ask(image), {"role": "assistant", "content": PREFILL}]
    runner = Runner(loaded)
    record = runner.encode(messages, switches=CONTINUE)
    want_ids = _continued_ids(loaded, messages, image)
    image_token = loaded.vision.image_token_id
    assert [image_token if t >= PLACEHOLDER_BASE else t for t in record] == want_ids
    closed = runner.encode(messages)  # without the switch: its end of turn, then a new one
    assert closed[: len(record)] == record and len(closed) > len(record)
    chunks = list(
        runner.stream(
            messages, switches=CONTINUE, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0
        )
    )
    completion = chunks[-1].completion
    want_tokens, want_logprob = _reference(loaded, messages, image, want_ids, MAX_TOKENS)
    assert completion.prompt_tokens == len(record)
    assert completion.tokens == want_tokens
    assert chunks[0].logprob.logprob == pytest.approx(want_logprob, abs=1e-3)


def test_a_continued_reply_with_an_image_sent_back_whole_is_reused_in_full(loaded, image):
    """The prefill's ids are the reply's start, as in a text prompt (`ImageTokens.reply_start`):
    the prefill and the reply sent back as one message take the ids the cache holds, and the
    next turn answers as a Runner with no cache does on the same messages."""
    asked = _ask(image)
    runner = Runner(loaded)
    prefilled = [*asked, {"role": "assistant", "content": PREFILL}]
    reply = runner.generate(prefilled, switches=CONTINUE, max_tokens=MAX_TOKENS, temperature=0.0)
    held = runner.cache_tokens
    sent_back = [*asked, {"role": "assistant", "content": PREFILL + reply.text}]
    sent_back.append({"role": "user", "content": "And then?"})
    answers = []
    for fresh in (runner, Runner(loaded)):
        chunks = list(fresh.stream(sent_back, max_tokens=3, temperature=0.0, logprobs=0))
        answers.append((chunks[-1].completion, [c.logprob.logprob for c in chunks if c.logprob]))
    (got, got_logprobs), (want, want_logprobs) = answers
    assert got.cached_tokens == len(held)
    assert want.cached_tokens == 0 and got.prompt_tokens == want.prompt_tokens
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got_logprobs, want_logprobs, atol=1e-3)
