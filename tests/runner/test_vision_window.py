"""A conversation with images longer than the window: cut at message boundaries (whole oldest
messages after the system prompt; an image is never split), answered as a fresh Runner answers
the cut conversation; a last message that cannot fit alone is refused."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest

pytest.importorskip("mlx_vlm")

from PIL import Image  # noqa: E402

from mlxkv import Runner  # noqa: E402
from mlxkv.errors import ContextLengthError  # noqa: E402
from mlxkv.models.loading import load_model  # noqa: E402
from mlxkv.testing.vision_factory import FAMILIES, build_vision_model  # noqa: E402

MAX_TOKENS = 6
_LONG = "Describe the picture: the quick brown fox jumps over the lazy dog. " * 16


@pytest.fixture(scope="module", params=list(FAMILIES))
def loaded(tmp_path_factory, request):
    out = tmp_path_factory.mktemp("vlm") / request.param
    return load_model(build_vision_model(out, family=request.param))


def _image(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (56, 56, 3), dtype=np.uint8))


def _conversation() -> list[dict]:
    """System, a long first turn about image A, a turn about image B, a short question."""
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image", "image": _image(1)}, _text(_LONG * 2)]},
        {"role": "assistant", "content": "A fox."},
        {"role": "user", "content": [{"type": "image", "image": _image(2)}, _text("And this?")]},
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
    with caplog.at_level(logging.INFO, logger="mlxkv.runner.request"):
        got = _greedy(runner, messages)
    line = next(r.getMessage() for r in caplog.records if "prompt with images cut" in r.message)
    assert int(re.search(r"cut at message (\d+)", line).group(1)) == 3, line
    want = _greedy(fresh, from_image_b)
    assert got.prompt_tokens == kept
    assert got.tokens == want.tokens
    assert got.first_logprob == pytest.approx(want.first_logprob, abs=1e-4)


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
    messages = [{"role": "user", "content": [{"type": "image", "image": _image(1)}, _text(_LONG)]}]
    runner = Runner(loaded, max_context=64)
    with pytest.raises(ContextLengthError, match="last user message"):
        runner.generate(messages, max_tokens=4)
