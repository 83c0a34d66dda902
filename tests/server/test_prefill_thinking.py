"""A continued last assistant message (Anthropic's prefill, OpenAI's `continue_final_message`)
on a thinking model: the reply is split where the continued text leaves it, not where a new
turn's generation prompt would. A prefill inside a thought (`<think>\\nLet`) goes on as
thinking (Anthropic `thinking` blocks, OpenAI `reasoning_content`) until the model closes it;
one after `</think>` goes on as the answer, also where the template's generation prompt opens
a thought (which a continued message does not render); Ollama's chat (`message.thinking`)
alike. The text is a fresh Runner's on the
chat Hugging Face's `continue_final_message` renders. Scripted models answer
`<think>Let think.</think>Paris`, each piece following the one before it."""

from __future__ import annotations

import contextlib

import ollama
import pytest

from mlxkv import Runner
from mlxkv.models.loading import load_model
from tests.server.conftest import OPENING_TEMPLATE, THINKING_TEMPLATE, build_template_model, serve

SCRIPT = ("<think>", "Let", "think.", "</think>", "Paris")
ASK = [{"role": "user", "content": "Capital of France?"}]
TEMPLATES = {"qwen3": THINKING_TEMPLATE, "opening": OPENING_TEMPLATE}
# (template, prefill, the reply's thinking, its answer)
CASES = {
    "inside_thought": ("qwen3", "<think>\nLet", "think.", "Paris"),
    "after_thought": ("qwen3", "<think>\nLet think.</think>", "", "Paris"),
    "opening_inside_thought": ("opening", "<think>\nLet", "think.", "Paris"),
    "opening_after_thought": ("opening", "<think>\nLet think.</think>", "", "Paris"),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each template's scripted model directory, by the template's name."""
    return {
        name: build_template_model(tmp_path_factory.mktemp(name), SCRIPT, template)
        for name, template in TEMPLATES.items()
    }


@pytest.fixture(scope="module")
def servers(models):
    with contextlib.ExitStack() as stack:
        yield {
            name: stack.enter_context(serve(Runner(load_model(path), max_context=512)))
            for name, path in models.items()
        }


def _reference(model_dir, messages) -> str:
    """A fresh Runner's reply on the chat as Hugging Face continues its last message."""
    runner = Runner(load_model(model_dir), max_context=512)
    text = runner.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    return runner.generate(text, max_tokens=16, temperature=0.0).text


def _case(case, models):
    template, prefill, thinking, answer = CASES[case]
    messages = [*ASK, {"role": "assistant", "content": prefill}]
    reference = _reference(models[template], messages)
    assert reference == (f"{thinking}</think>{answer}" if thinking else answer)
    return template, messages, thinking, answer


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_anthropic_prefill_goes_on_where_its_text_leaves_the_thinking(
    case, stream, servers, models
):
    template, messages, thinking, answer = _case(case, models)
    client = servers[template].anthropic()
    options = {"model": "m", "messages": messages, "max_tokens": 16}
    if stream:
        with client.messages.stream(**options) as events:
            out = events.get_final_message()
    else:
        out = client.messages.create(**options)
    expected = [{"type": "text", "text": answer}]
    if thinking:
        expected.insert(0, {"type": "thinking", "thinking": thinking, "signature": ""})
    assert [b.model_dump(exclude_none=True) for b in out.content] == expected


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_openai_continue_final_message_gives_the_thought_as_reasoning_content(
    case, stream, servers, models
):
    template, messages, thinking, answer = _case(case, models)
    client = servers[template].openai()
    options = {"model": "m", "messages": messages, "max_tokens": 16, "temperature": 0}
    body = {"continue_final_message": True}
    if stream:
        chunks = list(client.chat.completions.create(**options, stream=True, extra_body=body))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
    else:
        message = client.chat.completions.create(**options, extra_body=body).choices[0].message
        reasoning = getattr(message, "reasoning_content", None) or ""
        content = message.content
    assert (reasoning, content) == (thinking, answer)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_ollama_chat_gives_the_thought_as_thinking(case, servers, models):
    template, messages, thinking, answer = _case(case, models)
    client = ollama.Client(host=servers[template].url)
    reply = client.chat(model="m", messages=messages, options={"temperature": 0})
    assert (reply.message.thinking or "", reply.message.content) == (thinking, answer)
