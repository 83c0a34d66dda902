"""Each API's thinking setting reaches a chat template that has a thinking switch (Qwen3's
`enable_thinking`: off renders an empty `<think></think>` after the generation prompt; on is
mlx-lm's default for a vocabulary with thinking tokens), and changes nothing for a template
without one."""

from __future__ import annotations

import anthropic
import ollama
import pytest

from mlxkv import Runner
from mlxkv.models.loading import load_model
from mlxkv.testing.factory import CHAT_TEMPLATE, build_model
from tests.server.conftest import serve

# Qwen3's switch, as its template writes it.
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "<|im_start|>assistant\n{% endif %}",
    "<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}",
)
ASK = [{"role": "user", "content": "Is 17 prime?"}]


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    path = build_model(
        "llama",
        tmp_path_factory.mktemp("thinker") / "model",
        chat_template=THINKING_TEMPLATE,
        added_tokens=("<think>", "</think>"),
    )
    with serve(Runner(load_model(path), max_context=512)) as served:
        yield served


@pytest.fixture(scope="module")
def plain(loaded_tiny):
    with serve(Runner(loaded_tiny("llama"), max_context=512)) as served:
        yield served


def _anthropic_tokens(served, thinking: dict | None) -> int:
    extra = {} if thinking is None else {"thinking": thinking}
    client = served.anthropic()
    counted = client.messages.count_tokens(model="m", messages=ASK, extra_body=extra).input_tokens
    reply = client.messages.create(model="m", messages=ASK, max_tokens=1, extra_body=extra)
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == counted
    return counted


def _openai_tokens(served, **options) -> int:
    reply = served.openai().chat.completions.create(
        model="m", messages=ASK, max_tokens=1, **options
    )
    return reply.usage.prompt_tokens


def test_anthropic_thinking_disabled_turns_the_switch_off(thinker):
    default = _anthropic_tokens(thinker, None)
    assert _anthropic_tokens(thinker, {"type": "disabled"}) > default
    assert _anthropic_tokens(thinker, {"type": "enabled", "budget_tokens": 1024}) == default
    assert _anthropic_tokens(thinker, {"type": "adaptive"}) == default


def test_openai_reasoning_effort_and_chat_template_kwargs(thinker):
    default = _openai_tokens(thinker)
    off = _openai_tokens(thinker, reasoning_effort="none")
    assert off > default
    assert _openai_tokens(thinker, reasoning_effort="low") == default
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    assert _openai_tokens(thinker, extra_body=kwargs) == off
    reply = thinker.openai().responses.create(
        model="m", input=ASK, max_output_tokens=1, reasoning={"effort": "none"}
    )
    assert reply.usage.input_tokens == off


def test_ollama_think(thinker):
    client = ollama.Client(host=thinker.url)
    counts = [
        client.chat(
            model="m", messages=ASK, think=think, options={"num_predict": 1}
        ).prompt_eval_count
        for think in (None, False)
    ]
    assert counts[1] > counts[0]


def test_a_template_without_the_switch_is_unaffected(plain):
    default = _openai_tokens(plain)
    assert _openai_tokens(plain, reasoning_effort="none") == default
    kwargs = {"chat_template_kwargs": {"enable_thinking": False, "messages": [], "tools": 3}}
    assert _openai_tokens(plain, extra_body=kwargs) == default
    assert _anthropic_tokens(plain, {"type": "disabled"}) == _anthropic_tokens(plain, None)


def test_an_unknown_thinking_type_is_a_400(plain):
    with pytest.raises(anthropic.BadRequestError, match="thinking.type"):
        plain.anthropic().messages.create(
            model="m", messages=ASK, max_tokens=1, extra_body={"thinking": {"type": "maybe"}}
        )
