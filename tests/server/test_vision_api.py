"""Images through every API with the real clients: OpenAI chat `image_url`, Responses
`input_image`, Anthropic `image` blocks, Ollama `images`; each answer equals the Python API's
for the same messages, image tokens count in the usage, and a text-only model answers 400 in
each API's own shape."""

from __future__ import annotations

import base64
import dataclasses
import io

import anthropic
import ollama
import openai
import pytest

pytest.importorskip("mlx_vlm")


from mlxkv import Runner  # noqa: E402
from mlxkv.models.loading import load_model  # noqa: E402
from mlxkv.runner.text.chat import CONTINUE_FINAL  # noqa: E402
from mlxkv.testing.vision_factory import build_vision_model, noise_image  # noqa: E402
from tests.server.conftest import serve  # noqa: E402

MAX_TOKENS = 5
QUESTION = "What is this?"


def _png() -> bytes:
    out = io.BytesIO()
    noise_image(3).save(out, format="PNG")
    return out.getvalue()


B64 = base64.b64encode(_png()).decode()
DATA_URL = f"data:image/png;base64,{B64}"


# M-RoPE, sliding windows and tiled images: one family of each through every API.
@pytest.fixture(scope="module", params=["qwen2_vl", "gemma3", "smolvlm"])
def served(tmp_path_factory, request):
    out = tmp_path_factory.mktemp("vlm") / request.param
    loaded = load_model(build_vision_model(out, family=request.param))
    with serve(Runner(loaded), model_name="tiny-vl") as served:
        yield served


@pytest.fixture(scope="module")
def text_only(loaded_tiny):
    with serve(Runner(loaded_tiny("llama"), max_context=512), model_name="tiny") as served:
        yield served


def _expected(runner: Runner, image_first: bool = True):
    parts = [{"type": "image", "image": _png()}, {"type": "text", "text": QUESTION}]
    messages = [{"role": "user", "content": parts if image_first else parts[::-1]}]
    return runner.generate(messages, max_tokens=MAX_TOKENS, temperature=0.0)


def test_openai_chat_takes_an_image_url_and_counts_its_tokens(served):
    want = _expected(served.runner)
    content = [
        {"type": "image_url", "image_url": {"url": DATA_URL}},
        {"type": "text", "text": QUESTION},
    ]
    client = served.openai()
    reply = client.chat.completions.create(
        model="tiny-vl", messages=[{"role": "user", "content": content}],
        max_tokens=MAX_TOKENS, temperature=0.0,
    )  # fmt: skip
    assert reply.choices[0].message.content == want.text
    assert reply.usage.prompt_tokens == want.prompt_tokens
    assert reply.usage.prompt_tokens_details.cached_tokens >= want.prompt_tokens - 1


def test_responses_take_an_input_image(served):
    want = _expected(served.runner)
    content = [
        {"type": "input_image", "image_url": DATA_URL},
        {"type": "input_text", "text": QUESTION},
    ]
    reply = served.openai().responses.create(
        model="tiny-vl", input=[{"role": "user", "content": content}],
        max_output_tokens=MAX_TOKENS, temperature=0.0,
    )  # fmt: skip
    assert reply.output_text == want.text
    assert reply.usage.input_tokens == want.prompt_tokens


def test_anthropic_takes_a_base64_image_block(served):
    want = _expected(served.runner)
    source = {"type": "base64", "media_type": "image/png", "data": B64}
    content = [{"type": "image", "source": source}, {"type": "text", "text": QUESTION}]
    reply = served.anthropic().messages.create(
        model="tiny-vl", messages=[{"role": "user", "content": content}],
        max_tokens=MAX_TOKENS, extra_body={"temperature": 0.0},
    )  # fmt: skip
    assert reply.content[0].text == want.text
    counted = served.anthropic().messages.count_tokens(
        model="tiny-vl", messages=[{"role": "user", "content": content}]
    )
    assert counted.input_tokens == want.prompt_tokens
    usage = reply.usage
    total = usage.input_tokens + (usage.cache_read_input_tokens or 0)
    assert total + (usage.cache_creation_input_tokens or 0) == want.prompt_tokens


def test_anthropic_continues_a_prefill_after_an_image(served):
    """The reply is the Python API's on the chat continued (`CONTINUE_FINAL`), not the one
    on a closed turn (tests/runner/vision/test_vision_continue_final.py checks that against
    mlx-vlm)."""
    prefill = {"role": "assistant", "content": "It shows"}
    parts = [{"type": "image", "image": _png()}, {"type": "text", "text": QUESTION}]
    messages = [{"role": "user", "content": parts}, prefill]
    want = served.runner.generate(
        messages, switches={CONTINUE_FINAL: True}, max_tokens=MAX_TOKENS, temperature=0.0
    )
    source = {"type": "base64", "media_type": "image/png", "data": B64}
    content = [{"type": "image", "source": source}, {"type": "text", "text": QUESTION}]
    reply = served.anthropic().messages.create(
        model="tiny-vl", messages=[{"role": "user", "content": content}, prefill],
        max_tokens=MAX_TOKENS, extra_body={"temperature": 0.0},
    )  # fmt: skip
    assert reply.content[0].text == want.text
    usage = reply.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == want.prompt_tokens
    closed = served.runner.encode(messages)  # the turn closed, then a new one's header
    assert len(closed) > want.prompt_tokens


def test_ollama_chat_and_generate_take_images(served):
    want = _expected(served.runner)
    client = ollama.Client(host=served.url)
    options = {"temperature": 0.0, "num_predict": MAX_TOKENS}
    chat = client.chat(
        model="tiny-vl", messages=[{"role": "user", "content": QUESTION, "images": [_png()]}],
        options=options,
    )  # fmt: skip
    assert chat.message.content == want.text
    assert chat.prompt_eval_count == want.prompt_tokens
    generated = client.generate(model="tiny-vl", prompt=QUESTION, images=[B64], options=options)
    assert generated.response == want.text


@pytest.mark.parametrize(
    ("url", "refused_as"),
    [
        ("http://127.0.0.1:9/cat.png", "not fetched by this server.*--fetch-images"),
        ("file:///etc/hostname", "a file: URL is not an image this server takes.*data: URL"),
    ],
    ids=["http", "file"],
)
def test_an_image_url_is_not_fetched(served, url, refused_as):
    content = [{"type": "image_url", "image_url": {"url": url}}]
    with pytest.raises(openai.BadRequestError, match=refused_as):
        served.openai().chat.completions.create(
            model="tiny-vl", messages=[{"role": "user", "content": content}], max_tokens=2
        )


def test_an_image_for_a_text_model_is_a_400_in_each_api_shape(text_only):
    """Each API's refusal names the model as served ("tiny"), never the file it was loaded
    from (noise to the client, and the server's file layout)."""
    refused_as = "model tiny does not take images"
    image = [{"type": "image_url", "image_url": {"url": DATA_URL}}]
    with pytest.raises(openai.BadRequestError, match=refused_as) as refused:
        text_only.openai().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": image}], max_tokens=2
        )
    assert refused.value.body["type"] == "invalid_request_error"
    part = {"type": "input_image", "image_url": DATA_URL}
    with pytest.raises(openai.BadRequestError, match=refused_as):
        text_only.openai().responses.create(
            model="tiny", input=[{"role": "user", "content": [part]}], max_output_tokens=2
        )
    source = {"type": "base64", "media_type": "image/png", "data": B64}
    block = [{"type": "image", "source": source}]
    messages = [{"role": "user", "content": block}]
    with pytest.raises(anthropic.BadRequestError, match=refused_as):
        text_only.anthropic().messages.create(model="tiny", messages=messages, max_tokens=2)
    with pytest.raises(anthropic.BadRequestError, match=refused_as):
        text_only.anthropic().messages.count_tokens(model="tiny", messages=messages)
    with pytest.raises(ollama.ResponseError, match=refused_as) as ollama_refused:
        ollama.Client(host=text_only.url).chat(
            model="tiny", messages=[{"role": "user", "content": "hi", "images": [B64]}]
        )
    assert ollama_refused.value.status_code == 400
    with pytest.raises(ollama.ResponseError, match=refused_as):
        ollama.Client(host=text_only.url).generate(model="tiny", prompt="hi", images=[B64])
    assert text_only.runner.cache_tokens == []


@pytest.fixture(scope="module")
def image_host():
    """A local HTTP server answering every GET with the PNG (the test's remote host); the
    paths asked for are in its `asked` list."""
    import http.server
    import threading

    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            asked.append(self.path)
            body = _png() if self.path == "/cat.png" else b""
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=host.serve_forever, daemon=True)
    thread.start()
    yield _Host(f"http://127.0.0.1:{host.server_address[1]}", asked)
    host.shutdown()


@dataclasses.dataclass
class _Host:
    url: str
    asked: list[str]

    def __str__(self) -> str:
        return self.url


def test_an_image_url_is_fetched_where_the_operator_allows_it(served, image_host):
    want = _expected(served.runner)
    with serve(served.runner, model_name="tiny-vl", fetch_images=True) as fetching:
        content = [
            {"type": "image_url", "image_url": {"url": f"{image_host}/cat.png"}},
            {"type": "text", "text": QUESTION},
        ]
        reply = fetching.openai().chat.completions.create(
            model="tiny-vl", messages=[{"role": "user", "content": content}],
            max_tokens=MAX_TOKENS, temperature=0.0,
        )  # fmt: skip
        assert reply.choices[0].message.content == want.text
        # a request's choices fetch its image once
        image_host.asked.clear()
        reply = fetching.openai().chat.completions.create(
            model="tiny-vl", messages=[{"role": "user", "content": content}], n=3,
            max_tokens=MAX_TOKENS, temperature=0.0,
        )  # fmt: skip
        assert [c.message.content for c in reply.choices] == [want.text] * 3
        assert image_host.asked == ["/cat.png"]
        source = {"type": "url", "url": f"{image_host}/missing.png"}
        with pytest.raises(anthropic.BadRequestError, match="could not fetch the image"):
            fetching.anthropic().messages.create(
                model="tiny-vl", max_tokens=2,
                messages=[{"role": "user", "content": [{"type": "image", "source": source}]}],
            )  # fmt: skip


def test_a_client_string_is_never_read_as_a_local_file(served, tmp_path):
    """Sent raw: the `ollama` client itself reads a path it is given (on the client's side)."""
    picture = tmp_path / "on-the-server.png"
    picture.write_bytes(_png())
    message = {"role": "user", "content": "hi", "images": [str(picture)]}
    status, answer = served.post("/api/chat", {"model": "tiny-vl", "messages": [message]})
    assert status == 400
    assert "not valid base64" in answer["error"]


def test_anthropic_takes_an_image_in_a_tool_result(served):
    """Claude Code's Read of a screenshot (and an MCP browser tool's capture) comes back as an
    `image` block inside `tool_result` content, a shape the anthropic SDK types allow."""
    tools = [{"name": "read", "description": "Reads a file", "input_schema": {"type": "object"}}]
    call = {"id": "toolu_01", "type": "function", "function": {"name": "read", "arguments": {}}}
    image = {"type": "image", "image": _png()}
    want = served.runner.generate(
        [
            {"role": "user", "content": "Read shot.png"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "toolu_01", "content": [image]},
        ],
        tools=[{"type": "function", "function": {"name": "read", "description": "Reads a file",
                                                 "parameters": {"type": "object"}}}],
        max_tokens=MAX_TOKENS, temperature=0.0,
    )  # fmt: skip
    source = {"type": "base64", "media_type": "image/png", "data": B64}
    result = {"type": "tool_result", "tool_use_id": "toolu_01", "content": [
        {"type": "image", "source": source}]}  # fmt: skip
    reply = served.anthropic().messages.create(
        model="tiny-vl", max_tokens=MAX_TOKENS, tools=tools, extra_body={"temperature": 0.0},
        messages=[
            {"role": "user", "content": "Read shot.png"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_01", "name": "read", "input": {}}]},
            {"role": "user", "content": [result]},
        ],
    )  # fmt: skip
    assert reply.content[0].text == want.text
    usage = reply.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == want.prompt_tokens
