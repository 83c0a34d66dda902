"""Review probes of Anthropic `tool_result` content with image blocks (merge 79d3899), with the
real `anthropic` client: several images and text mixed in one result, an error result with an
image, streaming, and the refusals (a text-only model, a document, a URL source) in
Anthropic's error shape. Answers equal the Python API's for the same messages."""

from __future__ import annotations

import base64
import io

import anthropic
import pytest

pytest.importorskip("mlx_vlm")

from mlxkv import Runner  # noqa: E402
from mlxkv.models.loading import load_model  # noqa: E402
from mlxkv.testing.vision_factory import build_vision_model, noise_image  # noqa: E402
from tests.server.conftest import serve  # noqa: E402

MAX_TOKENS = 5
_TOOL = {"name": "read", "description": "Reads a file", "input_schema": {"type": "object"}}
_FUNCTION = {
    "type": "function",
    "function": {"name": "read", "description": "Reads a file", "parameters": {"type": "object"}},
}
_CALL = {"id": "toolu_01", "type": "function", "function": {"name": "read", "arguments": {}}}


def _png(seed: int) -> bytes:
    out = io.BytesIO()
    noise_image(seed).save(out, format="PNG")
    return out.getvalue()


def _block(seed: int) -> dict:
    data = base64.b64encode(_png(seed)).decode()
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}


@pytest.fixture(scope="module", params=["qwen2_vl", "gemma3"])
def served(tmp_path_factory, request):
    out = tmp_path_factory.mktemp("vlm") / request.param
    loaded = load_model(build_vision_model(out, family=request.param))
    with serve(Runner(loaded), model_name="tiny-vl") as served:
        yield served


@pytest.fixture(scope="module")
def text_only(loaded_tiny):
    with serve(Runner(loaded_tiny("llama"), max_context=512), model_name="tiny") as served:
        yield served


def _anthropic_messages(content, is_error: bool = False) -> list[dict]:
    result = {"type": "tool_result", "tool_use_id": "toolu_01", "content": content}
    if is_error:
        result["is_error"] = True
    return [
        {"role": "user", "content": "Read the shots."},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_01", "name": "read", "input": {}}],
        },
        {"role": "user", "content": [result]},
    ]


def _want(runner: Runner, tool_content) -> object:
    return runner.generate(
        [
            {"role": "user", "content": "Read the shots."},
            {"role": "assistant", "content": "", "tool_calls": [_CALL]},
            {"role": "tool", "tool_call_id": "toolu_01", "content": tool_content},
        ],
        tools=[_FUNCTION],
        max_tokens=MAX_TOKENS,
        temperature=0.0,
    )


def _image(seed: int) -> dict:
    return {"type": "image", "image": _png(seed)}


def test_a_tool_result_with_two_images_and_text_between(served):
    content = [
        {"type": "text", "text": "first:"},
        _block(1),
        {"type": "text", "text": "second:"},
        _block(2),
    ]
    want = _want(
        served.runner,
        [
            {"type": "text", "text": "first:"},
            _image(1),
            {"type": "text", "text": "second:"},
            _image(2),
        ],
    )
    reply = served.anthropic().messages.create(
        model="tiny-vl",
        max_tokens=MAX_TOKENS,
        tools=[_TOOL],
        messages=_anthropic_messages(content),
        extra_body={"temperature": 0.0},
    )
    assert reply.content[0].text == want.text
    usage = reply.usage
    total = usage.input_tokens + (usage.cache_read_input_tokens or 0)
    assert total + (usage.cache_creation_input_tokens or 0) == want.prompt_tokens
    counted = served.anthropic().messages.count_tokens(
        model="tiny-vl", tools=[_TOOL], messages=_anthropic_messages(content)
    )
    assert counted.input_tokens == want.prompt_tokens


def test_an_error_result_with_an_image_says_error_first(served):
    content = [{"type": "text", "text": "could not crop"}, _block(3)]
    want = _want(
        served.runner,
        [
            {"type": "text", "text": "Error: "},
            {"type": "text", "text": "could not crop"},
            _image(3),
        ],
    )
    reply = served.anthropic().messages.create(
        model="tiny-vl",
        max_tokens=MAX_TOKENS,
        tools=[_TOOL],
        messages=_anthropic_messages(content, is_error=True),
        extra_body={"temperature": 0.0},
    )
    assert reply.content[0].text == want.text


def test_a_streamed_reply_to_a_tool_result_image(served):
    content = [_block(4)]
    want = _want(served.runner, [_image(4)])
    with served.anthropic().messages.stream(
        model="tiny-vl",
        max_tokens=MAX_TOKENS,
        tools=[_TOOL],
        messages=_anthropic_messages(content),
        extra_body={"temperature": 0.0},
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == want.text
    assert final.usage.output_tokens == len(want.tokens)


def test_a_tool_result_image_for_a_text_model_is_a_400_in_anthropic_shape(text_only):
    with pytest.raises(anthropic.BadRequestError, match="does not take images") as refused:
        text_only.anthropic().messages.create(
            model="tiny", max_tokens=2, tools=[_TOOL], messages=_anthropic_messages([_block(1)])
        )
    assert refused.value.body["type"] == "error"
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert text_only.runner.cache_tokens == []


def test_a_streamed_tool_result_image_for_a_text_model_is_a_400(text_only):
    stream = text_only.anthropic().messages.stream(
        model="tiny", max_tokens=2, tools=[_TOOL], messages=_anthropic_messages([_block(1)])
    )
    with pytest.raises(anthropic.BadRequestError, match="does not take images"), stream as events:
        "".join(events.text_stream)


@pytest.mark.parametrize(
    "block, message",
    [
        (
            {
                "type": "document",
                "source": {"type": "text", "data": "x", "media_type": "text/plain"},
            },
            "document blocks are not supported",
        ),
        (
            {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1:9/a.png"}},
            "not fetched",
        ),
    ],
)
def test_a_tool_result_document_or_url_image_is_a_400(served, block, message):
    with pytest.raises(anthropic.BadRequestError, match=message) as refused:
        served.anthropic().messages.create(
            model="tiny-vl", max_tokens=2, tools=[_TOOL], messages=_anthropic_messages([block])
        )
    if block["type"] == "document":  # a URL is refused where URLs are fetched, unnamed
        assert "messages.2.content.0.content.0" in str(refused.value)


def test_ollama_chat_with_an_image_and_repeat_penalty(served):
    """Ollama's `repeat_penalty` (Open WebUI's parameter form sends it) on a prompt whose last
    20 ids hold image placeholders: an answer (the server process died with SIGSEGV before
    the processors skipped them), as the Python API's with the same settings."""
    import ollama

    question = [_image(5), {"type": "text", "text": "What is this?"}]
    want = served.runner.generate(
        [{"role": "user", "content": question}],
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        repetition_penalty=1.1,
    )
    chat = ollama.Client(host=served.url).chat(
        model="tiny-vl",
        messages=[{"role": "user", "content": "What is this?", "images": [_png(5)]}],
        options={"temperature": 0.0, "num_predict": MAX_TOKENS, "repeat_penalty": 1.1},
    )
    assert chat.message.content == want.text
