"""A last assistant message is continued ("prefill"): always in Anthropic's Messages API and
Ollama's chat (as both do), with vLLM's `continue_final_message` in OpenAI's chat. Each reply
equals a fresh Runner's on the chat Hugging Face's `continue_final_message` renders (the
independent reference): the template's text cut right after that message, no end of turn."""

from __future__ import annotations

import ollama
import pytest

from mlxkv.server.ollama_api.protocol import ChatRequest
from tests.server.conftest import serve

QUESTION = [{"role": "user", "content": "Tell me a story"}]
PREFILLED = [*QUESTION, {"role": "assistant", "content": "Once upon"}]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def served(loaded_tiny):
    from mlxkv import Runner

    with serve(Runner(loaded_tiny("llama"), max_context=1024)) as server:
        yield server


@pytest.fixture(scope="module")
def reference(loaded_tiny):
    """The reply's text and log-probabilities on the continued chat, from a fresh Runner."""
    from mlxkv import Runner

    runner = Runner(loaded_tiny("llama"), max_context=1024)
    text = runner.tokenizer.apply_chat_template(
        PREFILLED, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert text.endswith("Once upon")
    chunks = list(runner.stream(text, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0))
    logprobs = [c.logprob.logprob for c in chunks if c.logprob is not None]
    return "".join(c.text for c in chunks), logprobs


def test_anthropic_continues_a_last_assistant_message(served, reference):
    out = served.anthropic().messages.create(
        model="m", messages=PREFILLED, max_tokens=MAX_TOKENS, extra_body={"temperature": 0}
    )
    assert out.content[0].text == reference[0]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_continues_with_continue_final_message(served, reference, stream):
    options = {"model": "m", "messages": PREFILLED, "max_tokens": MAX_TOKENS, "temperature": 0}
    body = {"continue_final_message": True}
    client = served.openai()
    if stream:
        chunks = client.chat.completions.create(**options, stream=True, extra_body=body)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        out = client.chat.completions.create(**options, logprobs=True, extra_body=body)
        text = out.choices[0].message.content
        got = [t.logprob for t in out.choices[0].logprobs.content]
        assert got == pytest.approx(reference[1], abs=1e-4)
    assert text == reference[0]
    closed = client.chat.completions.create(**options)  # without it: a new turn, as OpenAI's
    assert closed.choices[0].message.content != reference[0] or reference[0] == ""


def test_ollama_chat_continues_a_last_assistant_message(served, reference):
    client = ollama.Client(host=served.url)
    out = client.chat(
        model="m", messages=PREFILLED, options={"temperature": 0, "num_predict": MAX_TOKENS}
    )
    assert out.message.content == reference[0]
    assert ChatRequest(messages=QUESTION).template_switches()  # the switch is always there
