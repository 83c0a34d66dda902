"""A prompt's landmarks (where its system messages and its generation prompt end) from an
encoder that keeps the system messages' renders are those a fresh encoder finds, for every
kind of template the tests use; and what the encoder skips checking it need not check."""

import datetime as real_datetime

import pytest
import transformers.utils.chat_template_utils as hf_templates
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlxkv.runner.text.prompt import PromptEncoder
from mlxkv.testing.factory import CHAT_TEMPLATE, TOOLS_CHAT_TEMPLATE, build_model
from tests.runner.test_chat_render import SYSTEM_FIRST_ONLY

# Llama 3.2's way: the system turn carries today's date, read from the clock.
DATED = (
    "{% set date_string = strftime_now('%d %B %Y') %}"
    "<|im_start|>system\nToday Date: {{ date_string }}\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% endif %}<|im_end|>\n"
    "{% for message in messages %}{% if not (loop.first and message['role'] == 'system') %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Content trimmed and rewritten; a reasoning switch rendered in the system turn (gpt-oss).
REWRITING = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if loop.first and reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}\n"
    "{% endif %}{{ message['content'] | trim | replace('secret', '[hidden]') }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think></think>"
    "{% endif %}{% endif %}"
)
TEMPLATES = {
    "chatml": CHAT_TEMPLATE,
    "tools": TOOLS_CHAT_TEMPLATE,
    "system-first-only": SYSTEM_FIRST_ONLY,
    "dated": DATED,
    "rewriting": REWRITING,
}
SYSTEM = {"role": "system", "content": "  You are terse; the secret is 42.  "}
CHAT = [
    SYSTEM,
    {"role": "user", "content": "list the files"},
    {"role": "assistant", "content": "Which folder?"},
    {"role": "system", "content": "The user works in /src."},  # a reminder mid-chat
    {"role": "user", "content": "this one"},
]
TOOL = {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}
OTHER_TOOL = {"type": "function", "function": {"name": "cat", "parameters": {"type": "object"}}}
# One conversation's requests, each differing from the one before in one thing the system
# messages' render reads (or in nothing: then the kept render is taken).
REQUESTS = [
    (CHAT, {}),
    (CHAT, {}),
    (CHAT[:2], {}),
    (CHAT, {"tools": [TOOL]}),
    (CHAT, {"tools": [OTHER_TOOL]}),
    (CHAT, {"tools": [TOOL, OTHER_TOOL]}),
    (CHAT, {"tools": [OTHER_TOOL, TOOL]}),
    (CHAT, {"switches": {"reasoning_effort": "high"}}),
    (CHAT, {"switches": {"reasoning_effort": "low"}}),
    (CHAT, {"switches": {"enable_thinking": False}}),
    ([{**SYSTEM, "content": "You are verbose."}, *CHAT[1:]], {}),
    ([SYSTEM, {"role": "system", "content": "Second."}, *CHAT[1:]], {}),
    ([{**SYSTEM, "content": "x<|im_end|>y"}, *CHAT[1:]], {}),
    ([{**SYSTEM, "content": "x<|im_end|>y"}, *CHAT[1:]], {"parse_control_tokens": True}),
    (CHAT[1:], {}),
]


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def template_path(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param) / "model"
    return build_model("llama", out, chat_template=TEMPLATES[request.param])


def _landmarks(encoder: PromptEncoder, messages: list[dict], template: dict):
    tokens = encoder.encode(messages, **template)
    return tokens, encoder.landmarks.find(messages, tokens, system_tokens=True, **template)


def _outcome(encoder: PromptEncoder, messages: list[dict], template: dict):
    """The ids and landmarks, or the error (a template that refuses two system messages)."""
    try:
        return _landmarks(encoder, messages, template)
    except ValueError as error:
        return str(error)


def test_landmarks_equal_a_fresh_encoders_for_each_request(template_path):
    tokenizer = load_tokenizer(template_path)
    kept = PromptEncoder(tokenizer, 512)
    for i, (messages, template) in enumerate(REQUESTS):
        expected = _outcome(PromptEncoder(tokenizer, 512), messages, template)
        assert _outcome(kept, messages, template) == expected, f"request {i}"


def test_the_system_messages_are_rendered_once_for_the_same_input(tmp_path):
    encoder = PromptEncoder(load_tokenizer(build_model("llama", tmp_path / "m")), 512)
    rendered = []
    render = encoder.chat.render_prompt  # every render: `render` and `landmarks` both call it
    encoder.chat.render_prompt = lambda messages, **kwargs: (
        rendered.append(messages) or render(messages, **kwargs)
    )
    for _ in range(3):
        _landmarks(encoder, CHAT, {"tools": [TOOL]})
    assert rendered.count([SYSTEM]) == 1
    assert rendered.count(CHAT) == 6  # the prompt, and without the generation prompt


class _Clock:
    """transformers' `datetime` as the template's `strftime_now` reads it, set by the test."""

    today = real_datetime.datetime(2026, 11, 27)

    @classmethod
    def now(cls):
        return cls.today


def test_a_template_that_reads_the_clock_renders_the_new_date(tmp_path, monkeypatch):
    monkeypatch.setattr(hf_templates, "datetime", _Clock)
    tokenizer = load_tokenizer(build_model("llama", tmp_path / "m", chat_template=DATED))
    kept = PromptEncoder(tokenizer, 512)
    _, before = _landmarks(kept, CHAT, {})
    monkeypatch.setattr(_Clock, "today", real_datetime.datetime(2027, 1, 1))
    tokens, after = _landmarks(kept, CHAT, {})
    assert after == _landmarks(PromptEncoder(tokenizer, 512), CHAT, {})[1]
    assert "1 January 2027" in tokenizer.decode(tokens[: after.system_tokens])
    assert after.system_tokens != before.system_tokens


def test_a_tokenizer_with_ids_past_the_models_vocabulary_has_its_prompts_checked(tmp_path):
    tokenizer = load_tokenizer(build_model("llama", tmp_path / "m"))
    ids = PromptEncoder(tokenizer, max(tokenizer.get_vocab().values()) + 1).encode(CHAT)
    for prompt in (CHAT, tokenizer.decode(ids)):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            PromptEncoder(tokenizer, max(ids)).encode(prompt)


def test_a_reply_with_ids_past_the_vocabulary_renders_as_its_text(tmp_path):
    tokenizer = load_tokenizer(build_model("llama", tmp_path / "m"))
    encoder = PromptEncoder(tokenizer, max(tokenizer.get_vocab().values()) + 1)
    reply = CHAT[2]["content"]
    assert encoder.encode(CHAT, replies={reply: [encoder.vocab_size]}.get) == encoder.encode(CHAT)
    taken = encoder.encode(CHAT, replies={reply: [7, 8]}.get)
    assert taken != encoder.encode(CHAT) and taken.count(7) > encoder.encode(CHAT).count(7)
