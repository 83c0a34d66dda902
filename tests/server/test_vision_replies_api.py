"""A reply sent back by a real client in a conversation with an image (OpenAI chat, Anthropic
messages with the reply as text blocks, as Claude Code sends it) takes the ids the model
generated: the next turn reuses the whole first turn where the reply's text encodes
otherwise, and answers as the Python API does on the same messages (whose answer the runner
tests compare with mlx-vlm's own model: `tests/runner/vision/test_vision_replies.py`)."""

from __future__ import annotations

import base64
import io

import pytest

pytest.importorskip("mlx_vlm")


from mlxkv import Runner  # noqa: E402
from mlxkv.models.loading import load_model  # noqa: E402
from mlxkv.testing.vision_factory import build_vision_model, noise_images  # noqa: E402
from tests.server.conftest import serve  # noqa: E402

REPLY_TOKENS = 12  # long enough that the random model's reply encodes otherwise (asserted)
QUESTION = "Describe it."
NEXT = "And the colors?"


def _png() -> bytes:
    out = io.BytesIO()
    noise_images(5, [(56, 56, 3)])[0].save(out, format="PNG")
    return out.getvalue()


B64 = base64.b64encode(_png()).decode()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Qwen2-VL (M-RoPE; its template writes a reply right after its turn's header)."""
    loaded = load_model(build_vision_model(tmp_path_factory.mktemp("vlm") / "qwen2_vl"))
    with serve(Runner(loaded), model_name="tiny-vl") as served:
        yield served, loaded


def _python_turn2(reply: str) -> list[dict]:
    image = {"type": "image", "image": _png()}
    return [
        {"role": "user", "content": [image, {"type": "text", "text": QUESTION}]},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": NEXT},
    ]


def _expected(served, loaded, reply: str, salt: str | None = None):
    """The Python API's answer on a fresh Runner, after checking that the reply's ids are not
    its text's (a domain that never generated it renders the text)."""
    messages = _python_turn2(reply)
    ours = served.runner.encode(messages, cache_salt=salt)
    assert ours != served.runner.encode(messages, cache_salt="other"), "encodes as generated"
    options = {"max_tokens": REPLY_TOKENS, "temperature": 0.0, "cache_salt": salt}
    return Runner(loaded).generate(messages, **options)


def test_openai_chat_next_turn_reuses_a_reply_sent_back(served):
    served, loaded = served
    user = {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{B64}"}},
            {"type": "text", "text": QUESTION},
        ],
    }
    options = {"model": "tiny-vl", "max_tokens": REPLY_TOKENS, "temperature": 0.0}
    client = served.openai()
    first = client.chat.completions.create(messages=[user], **options)
    reply = first.choices[0].message.content
    want = _expected(served, loaded, reply)
    turn2 = [user, {"role": "assistant", "content": reply}, {"role": "user", "content": NEXT}]
    second = client.chat.completions.create(messages=turn2, **options)
    assert second.choices[0].message.content == want.text
    assert second.usage.prompt_tokens == want.prompt_tokens
    fed = first.usage.prompt_tokens + first.usage.completion_tokens - 1  # the last never fed
    assert second.usage.prompt_tokens_details.cached_tokens >= fed


def test_anthropic_next_turn_reuses_a_reply_sent_back_as_text_blocks(served):
    served, loaded = served
    source = {"type": "base64", "media_type": "image/png", "data": B64}
    user = {
        "role": "user",
        "content": [{"type": "image", "source": source}, {"type": "text", "text": QUESTION}],
    }
    options = {"model": "tiny-vl", "max_tokens": REPLY_TOKENS}
    options["extra_body"] = {"temperature": 0.0, "cache_salt": "anthropic-test"}
    client = served.anthropic()
    first = client.messages.create(messages=[user], **options)
    reply = first.content[0].text
    want = _expected(served, loaded, reply, "anthropic-test")
    turn2 = [
        user,
        {"role": "assistant", "content": [{"type": "text", "text": reply}]},
        {"role": "user", "content": NEXT},
    ]
    second = client.messages.create(messages=turn2, **options)
    usage = second.usage
    read = usage.cache_read_input_tokens or 0
    prompt = usage.input_tokens + read + (usage.cache_creation_input_tokens or 0)
    first_prompt = first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    first_prompt += first.usage.cache_creation_input_tokens or 0
    assert read >= first_prompt + first.usage.output_tokens - 1
    assert second.content[0].text == want.text
    assert prompt == want.prompt_tokens
