"""System messages between turns (Claude Code's reminders): rendered in place where the chat
template allows, folded into a user turn where it refuses them."""

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlxkv.runner.text.chat import ChatTemplate
from mlxkv.runner.text.messages import fold_system_reminders
from mlxkv.testing.factory import CHAT_TEMPLATE, build_model

# Gemma's and Mistral's templates raise like this for a system message that is not first.
SYSTEM_FIRST_ONLY = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('System role must come first') }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "list the files"},
    {"role": "assistant", "content": "Which folder?"},
    {"role": "system", "content": "The user works in /src."},
    {"role": "user", "content": "this one"},
]


def _encoder(tmp_path, template: str) -> ChatTemplate:
    path = build_model("llama", tmp_path / "model", chat_template=template)
    return ChatTemplate(load_tokenizer(path), 512)


def test_a_template_that_allows_it_renders_the_system_message_in_place(tmp_path):
    encoder = _encoder(tmp_path, CHAT_TEMPLATE)
    text = encoder.tokenizer.decode(encoder.render(CHAT))
    assert "<|im_start|>system\nThe user works in /src.<|im_end|>" in text


def test_a_template_that_refuses_it_gets_a_system_reminder_in_the_next_user_turn(tmp_path):
    encoder = _encoder(tmp_path, SYSTEM_FIRST_ONLY)
    text = encoder.tokenizer.decode(encoder.render(CHAT))
    reminder = "<system-reminder>\nThe user works in /src.\n</system-reminder>\n\nthis one"
    assert f"<|im_start|>user\n{reminder}<|im_end|>" in text
    assert text.count("<|im_start|>system") == 1


def test_a_trailing_system_message_joins_the_last_user_turn():
    folded = fold_system_reminders([*CHAT[:2], {"role": "system", "content": "Be brief."}])
    assert folded == [
        CHAT[0],
        {
            "role": "user",
            "content": "list the files\n\n<system-reminder>\nBe brief.\n</system-reminder>",
        },
    ]


def test_a_template_error_with_nothing_to_fold_is_a_value_error(tmp_path):
    encoder = _encoder(tmp_path, "{{ raise_exception('no tools here') }}")
    with pytest.raises(ValueError, match="chat template refused the messages: no tools here"):
        encoder.render(CHAT[:2])


def test_parts_get_the_reminder_as_a_text_part_and_a_system_image_stays():
    image = {"type": "image", "image": b"png"}
    user = {"role": "user", "content": [image, {"type": "text", "text": "this one"}]}
    note = {"role": "system", "content": [{"type": "text", "text": "In /src."}]}
    folded = fold_system_reminders([*CHAT[:3], note, user])
    reminder = "<system-reminder>\nIn /src.\n</system-reminder>\n\n"
    assert folded[3] == {**user, "content": [{"type": "text", "text": reminder}, *user["content"]]}
    pictured = {"role": "system", "content": [image]}  # not text: left for the template
    assert fold_system_reminders([*CHAT[:3], pictured, user]) == [*CHAT[:3], pictured, user]
