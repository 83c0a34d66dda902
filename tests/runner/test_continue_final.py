"""A render that continues the last assistant message (`CONTINUE_FINAL`: Anthropic's prefill)
ends with that message's text, as Hugging Face's `continue_final_message` cuts the rendered
chat (the independent reference here); client text in it stays text; any other last message
renders as without the switch."""

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlxkv.runner.text.chat import CONTINUE_FINAL, ChatTemplate
from mlxkv.testing.factory import build_model

CONTINUE = {CONTINUE_FINAL: True}
QUESTION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a colour."},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(build_model("llama", tmp_path_factory.mktemp("continue") / "llama"))


def _hf_continued(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("prefill", ["Sure, ", "{", "The colour is"])
def test_the_render_ends_with_the_last_assistant_text(tokenizer, prefill):
    messages = [*QUESTION, {"role": "assistant", "content": prefill}]
    ids = ChatTemplate(tokenizer, 512).render(messages, switches=CONTINUE)
    assert ids == _hf_continued(tokenizer, messages)
    closed = ChatTemplate(tokenizer, 512).render(messages)  # its end of turn, a new one
    assert closed[: len(ids)] == ids and len(closed) > len(ids)


def test_control_token_text_in_the_prefill_stays_text(tokenizer):
    messages = [*QUESTION, {"role": "assistant", "content": "red<|im_end|>"}]
    ids = ChatTemplate(tokenizer, 512).render(messages, switches=CONTINUE)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    red = [*QUESTION, {"role": "assistant", "content": "red"}]
    head = ChatTemplate(tokenizer, 512).render(red, switches=CONTINUE)
    assert ids[: len(head)] == head and end_of_turn not in ids[len(head) :]


@pytest.mark.parametrize(
    "last",
    [
        {"role": "user", "content": "And another?"},
        {"role": "assistant", "content": ""},
        {"role": "assistant", "content": "x", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    ],
    ids=["user", "empty-assistant", "assistant-with-calls"],
)  # fmt: skip
def test_any_other_last_message_renders_as_without_the_switch(tokenizer, last):
    messages = [*QUESTION, last]
    chat = ChatTemplate(tokenizer, 512)
    assert chat.render(messages, switches=CONTINUE) == chat.render(messages)


# SmolVLM's and Idefics3's way (Mistral's is alike): a space between the role and the content.
SPACED_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize }}: "
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


@pytest.mark.parametrize("prefill", ["The colour is", "red"])
def test_the_continued_text_tokenizes_with_the_template_text_before_it(tmp_path, prefill):
    """The content's first word takes the space the template writes before it (` The`), as in
    the text Hugging Face cuts, not a token of its own."""
    path = build_model("llama", tmp_path / "spaced", chat_template=SPACED_TEMPLATE)
    tokenizer = load_tokenizer(path)
    messages = [*QUESTION, {"role": "assistant", "content": prefill}]
    ids = ChatTemplate(tokenizer, 512).render(messages, switches=CONTINUE)
    assert ids == _hf_continued(tokenizer, messages)
