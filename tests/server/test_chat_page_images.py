"""The chat page takes an image dropped or pasted into the composer, sends it with the next
message as an `image_url` part, shows it in the conversation, and the next turn reuses it
from the cache (checked against a fresh Runner given the same messages)."""

from __future__ import annotations

import base64
import io

import pytest

pytest.importorskip("mlx_vlm")


from mlxkv import Runner  # noqa: E402
from mlxkv.models.loading import load_model  # noqa: E402
from mlxkv.testing.vision_factory import build_vision_model, noise_image  # noqa: E402

from .chat_page import _current, _send, _set, open_page  # noqa: E402
from .conftest import serve  # noqa: E402

_PNG = io.BytesIO()
noise_image(5).save(_PNG, format="PNG")
B64 = base64.b64encode(_PNG.getvalue()).decode()
# A DataTransfer holding the PNG, as a drop or a paste carries it.
_TRANSFER = """(b64) => {
    const transfer = new DataTransfer();
    const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
    transfer.items.add(new File([bytes], "shot.png", { type: "image/png" }));
    return transfer;
}"""


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model(build_vision_model(tmp_path_factory.mktemp("vlm") / "qwen2_vl"))


@pytest.fixture
def page(browser, loaded):
    with (
        serve(Runner(loaded, cache_entries=4)) as served,
        open_page(browser, served.url + "/") as opened,
    ):
        yield opened


@pytest.mark.parametrize("how", ["drop", "paste"])
def test_an_attached_image_is_sent_shown_and_cached_for_the_next_turn(page, loaded, how):
    _set(page, "#temperature", "0")
    _set(page, "#max-tokens", "8")
    transfer = page.evaluate_handle(_TRANSFER, B64)
    if how == "drop":
        page.dispatch_event("#composer", "drop", {"dataTransfer": transfer})
    else:
        page.evaluate(
            "(t) => document.querySelector('#input').dispatchEvent("
            "new ClipboardEvent('paste', {clipboardData: t, bubbles: true, cancelable: true}))",
            transfer,
        )
    page.locator("#attachments img.thumb").wait_for()
    _send(page, "What is this?")
    assert page.locator(".message.user img.thumb").count() == 1
    assert page.locator("#attachments img.thumb").count() == 0  # sent with that message

    image = {"type": "image", "image": f"data:image/png;base64,{B64}"}
    question = [{"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}]
    reference = Runner(loaded)
    first = reference.generate(question, max_tokens=8, temperature=0.0)
    chat = _current(page)
    assert chat["messages"][1]["content"] == first.text
    assert chat["messages"][1]["stats"]["prompt"] == first.prompt_tokens

    _send(page, "And then?")
    chat = _current(page)
    follow_up = question + [
        {"role": "assistant", "content": chat["messages"][1]["content"]},
        {"role": "user", "content": "And then?"},
    ]
    second = reference.generate(follow_up, max_tokens=8, temperature=0.0)
    assert chat["messages"][-1]["content"] == second.text
    assert chat["messages"][-1]["stats"]["cached"] >= first.prompt_tokens  # the image too
