"""Bad images are refused before any model work, with a message that says which limit or
which part, and nothing is cached for a refused request."""

from __future__ import annotations

import base64
import io

import pytest

pytest.importorskip("mlx_vlm")

from jinja2 import TemplateError  # noqa: E402
from PIL import Image, ImageFile  # noqa: E402

from mlxkv import ImagesNotSupportedError, Runner  # noqa: E402
from mlxkv.models import images as image_limits  # noqa: E402
from mlxkv.models.loading import load_model  # noqa: E402
from mlxkv.models.vision import MAX_IMAGES_PER_PROMPT  # noqa: E402
from mlxkv.testing.vision_factory import build_vision_model, noise_image  # noqa: E402


def _png(width: int, height: int, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(out, format=fmt)
    return out.getvalue()


def _ask(image) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [{"type": "image", "image": image}, {"type": "text", "text": "hi"}],
        }
    ]


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    return Runner(load_model(build_vision_model(tmp_path_factory.mktemp("vlm") / "qwen2_vl")))


def test_an_image_for_a_text_model_is_refused_naming_the_model(make_runner):
    runner = make_runner("llama")
    with pytest.raises(ImagesNotSupportedError, match=r"model llama does not take images"):
        runner.generate(_ask(_png(56, 56)), max_tokens=2)  # a ValueError too
    assert runner.cache_tokens == []


@pytest.mark.parametrize(
    ("image", "message"),
    [
        ("data:image/png;base64,@@not base64@@", "not valid base64"),
        ("iVBORw0KGgo=", "could not decode the image"),
        ("iVBORw0KGgo=!!", "does not exist .a str image is a path"),
        (b"GIF89a-broken", "could not decode the image"),
        (_png(56, 56, "TIFF"), "image format TIFF is not supported"),
        (b"just some text", "could not decode the image"),
        (42, "an image must be a path, bytes"),
        ("/no/such/picture.png", "does not exist"),
    ],
)
def test_a_bad_image_is_refused_saying_why(runner, image, message):
    with pytest.raises(ValueError, match=message) as refused:
        runner.generate(_ask(image), max_tokens=2)
    assert runner.cache_tokens == []
    assert " object at 0x" not in str(refused.value), "a Python repr is no message"


def test_an_image_over_the_pixel_limit_is_refused_before_decoding(runner, monkeypatch):
    png = _png(101, 100)
    monkeypatch.setattr(image_limits, "MAX_IMAGE_PIXELS", 100 * 100)
    decoded = []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: decoded.append(self))
    with pytest.raises(ValueError, match=r"101x100 = 10,100 pixels; the limit is 10,000"):
        runner.generate(_ask(png), max_tokens=2)
    assert decoded == [], "the pixels were decoded before the header was checked"


def test_a_decompression_bomb_is_refused_before_decoding(runner):
    bomb = _png(8000, 8000)  # 64 megapixels of one colour: a few kilobytes of PNG
    assert len(bomb) < 1_000_000
    with pytest.raises(ValueError, match="8000x8000 = 64,000,000 pixels"):
        runner.generate(_ask(bomb), max_tokens=2)


def test_an_image_over_the_byte_limit_is_refused(runner):
    big = base64.b64encode(b"\0" * (image_limits.MAX_IMAGE_BYTES + 10)).decode()
    with pytest.raises(ValueError, match="the limit is 20,971,520 bytes"):
        runner.generate(_ask(big), max_tokens=2)


def test_more_images_than_the_model_takes_are_refused(runner):
    image = _png(56, 56)
    parts = [{"type": "image", "image": image}] * (MAX_IMAGES_PER_PROMPT + 1)
    with pytest.raises(ValueError, match="holds 17 images; this model takes at most 16"):
        runner.generate([{"role": "user", "content": parts}], max_tokens=2)
    assert runner.cache_tokens == []


def test_the_same_pixels_in_another_encoding_are_the_same_image(runner):
    image = noise_image(1)
    png, bmp = io.BytesIO(), io.BytesIO()
    image.save(png, format="PNG")
    image.save(bmp, format="BMP")
    as_data_url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    assert runner.encode(_ask(as_data_url)) == runner.encode(_ask(bmp.getvalue()))
    assert runner.encode(_ask(as_data_url)) == runner.encode(_ask(image))


def test_short_base64_holding_a_slash_is_base64_not_a_path(runner):
    for grey in range(256):  # the first solid colour whose PNG's base64 holds a "/"
        image = Image.new("RGB", (56, 56), (grey, grey, grey))
        out = io.BytesIO()
        image.save(out, format="PNG")
        short = base64.b64encode(out.getvalue()).decode()
        if "/" in short:
            break
    assert "/" in short and len(short) < 4096
    assert runner.encode(_ask(short)) == runner.encode(_ask(image))


def test_a_text_model_never_imports_mlx_vlm(model_root):
    """The vision extra stays optional: loading and running a text model (and refusing an
    image for it) leaves mlx-vlm unimported."""
    import subprocess
    import sys

    from tests.factories import tiny_model_dir

    model = tiny_model_dir("llama", model_root)
    script = (
        "import sys\n"
        "from mlxkv import Runner\n"
        f"runner = Runner.load({str(model)!r})\n"
        "runner.generate('hello', max_tokens=2)\n"
        "try:\n"
        "    runner.generate([{'role': 'user', 'content': [{'type': 'image', 'image': b'x'}]}])\n"
        "except ValueError:\n"
        "    pass\n"
        "print(sorted(m for m in sys.modules if m.startswith('mlx_vlm')))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_text_parts_without_an_image_are_the_string_prompt_on_a_vision_model(runner):
    """OpenAI-style text parts with no image take the text path, joined as the server joins
    them: the same ids and the same answer as the string (they were refused: no image)."""
    parts = [{"role": "user", "content": [{"type": "text", "text": t} for t in ("Say ", "hi")]}]
    text = [{"role": "user", "content": "Say hi"}]
    assert runner.encode(parts) == runner.encode(text)
    got = runner.generate(parts, max_tokens=4, temperature=0, logprobs=0)
    want = runner.generate(text, max_tokens=4, temperature=0, logprobs=0)
    assert got.tokens == want.tokens


def test_messages_with_an_image_the_template_refuses_are_a_value_error(runner, monkeypatch):
    """As a text prompt's: the template's own message, not jinja's TemplateError (a 500 with a
    traceback over HTTP), and nothing cached."""
    tokenizer = runner.tokenizer

    def refusing(messages, **options):
        raise TemplateError("roles must alternate")

    monkeypatch.setattr(tokenizer, "apply_chat_template", refusing, raising=False)
    before = list(runner.cache_tokens)
    with pytest.raises(ValueError, match="chat template refused the messages: roles must"):
        runner.generate(_ask(_png(56, 56)), max_tokens=2)
    assert runner.cache_tokens == before


@pytest.mark.parametrize(
    "messages, message",
    [
        ([{"role": "bad", "content": _ask(noise_image(1))[0]["content"]}], "has role 'bad'"),
        ([{"role": "system"}, *_ask(noise_image(1))], "message 0 needs a string 'content'"),
        ([{"role": "user", "content": 5}, *_ask(noise_image(1))], "got int"),
    ],
    ids=["unknown-role", "no-content", "int-content"],
)
def test_messages_beside_an_image_are_checked_as_text_ones_are(runner, messages, message):
    """A prompt with images rendered a role no chat has and dropped missing or non-text
    content without a word, where the same messages without images are refused."""
    held = runner.cache_tokens
    with pytest.raises(ValueError, match=message):
        runner.generate(messages, max_tokens=2)
    assert runner.cache_tokens == held


_SYSTEM_FIRST_ONLY = (  # Gemma's and Mistral's templates refuse a system message not first
    "{% for message in messages %}{% if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('System role must come first') }}{% endif %}{% endfor %}"
)


def test_a_system_message_after_the_first_turn_is_folded_beside_an_image(runner, monkeypatch):
    """Claude Code's reminders (system messages between turns) on a template that refuses
    them were refused with images in the prompt, where the same text prompt folds them into
    the next user turn: folded here too, as the user turn's first text part."""
    tokenizer = runner.tokenizer._tokenizer  # the wrapper passes it on
    monkeypatch.setattr(tokenizer, "chat_template", _SYSTEM_FIRST_ONLY + tokenizer.chat_template)
    image = noise_image(3)
    ask = _ask(image)[0]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": "Hi."},
        {"role": "system", "content": "The user works in /src."},
        ask,
    ]
    reminder = {
        "type": "text",
        "text": "<system-reminder>\nThe user works in /src.\n</system-reminder>\n\n",
    }
    by_hand = [*messages[:3], {**ask, "content": [reminder, *ask["content"]]}]
    assert runner.encode(messages) == runner.encode(by_hand)
    got = runner.generate(messages, max_tokens=4, temperature=0, logprobs=0)
    assert got.tokens == runner.generate(by_hand, max_tokens=4, temperature=0).tokens


def test_a_model_without_a_chat_template_refuses_images_in_one_line(runner, monkeypatch):
    monkeypatch.setattr(runner.tokenizer._tokenizer, "chat_template", None)
    held = runner.cache_tokens
    with pytest.raises(ValueError, match="has no chat template, which images need"):
        runner.generate(_ask(noise_image(1)), max_tokens=2)
    assert runner.cache_tokens == held


def test_prompt_logprobs_with_images_are_refused(runner):
    """An image's positions hold placeholder ids outside the vocabulary: no log-probability
    to report (gathered at them, they read past the logits)."""
    held = runner.cache_tokens  # the module's runner: what earlier tests left
    with pytest.raises(ValueError, match="prompt_logprobs is not supported for a prompt with"):
        runner.generate(_ask(_png(56, 56)), max_tokens=2, prompt_logprobs=1)
    assert runner.cache_tokens == held
