"""A thinking model's thinking apart from its answer in every API, read with the real
clients: OpenAI chat `reasoning_content`, a Responses `reasoning` item, Anthropic `thinking`
blocks, Ollama `thinking`; plain and streamed, for output that opens its thinking and for a
prompt that already did; tool calls after the thinking; a model without thinking tags
untouched. Scripted models (`build_scripted_model`) answer with `<think>Hmm.</think>Paris`."""

from __future__ import annotations

import json

import ollama
import pytest

from mlxkv import Runner
from mlxkv.models.loading import load_model
from mlxkv.testing.factory import TOOLS_CHAT_TEMPLATE
from tests.server.conftest import (
    OPENING_TEMPLATE,
    THINKING_TEMPLATE,
    TOOL_CALL,
    WEATHER,
    build_template_model,
    serve,
)

THOUGHT = ("<think>", "Hmm.", "</think>")
ASK = [{"role": "user", "content": "Capital of France?"}]
ANTHROPIC_TOOLS = [
    {
        "name": "get_weather",
        "description": WEATHER["function"]["description"],
        "input_schema": WEATHER["function"]["parameters"],
    }
]


def _served(tmp_path_factory, script, template, max_context=512):
    path = build_template_model(tmp_path_factory.mktemp("model"), script, template)
    with serve(Runner(load_model(path), max_context=max_context), model_name="m") as served:
        yield served


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    yield from _served(tmp_path_factory, (*THOUGHT, "Paris"), THINKING_TEMPLATE)


@pytest.fixture(scope="module")
def opener(tmp_path_factory):
    yield from _served(tmp_path_factory, (*THOUGHT, "Paris"), OPENING_TEMPLATE)


@pytest.fixture(scope="module")
def caller(tmp_path_factory):
    script = (*THOUGHT, "Let", "<tool_call>", TOOL_CALL, "</tool_call>")
    yield from _served(tmp_path_factory, script, THINKING_TEMPLATE, max_context=1024)


@pytest.fixture(scope="module")
def unthinking(tmp_path_factory):
    """`<think>` in the vocabulary but no `</think>`: mlx-lm sees no thinking tags."""
    path = build_template_model(
        tmp_path_factory.mktemp("plain"), ("<think>", "Paris"), TOOLS_CHAT_TEMPLATE
    )
    with serve(Runner(load_model(path), max_context=512), model_name="m") as served:
        yield served


def _openai_chat(served, **options) -> tuple[str | None, str]:
    reply = served.openai().chat.completions.create(model="m", messages=ASK, **options)
    message = reply.choices[0].message
    reasoning = getattr(message, "reasoning_content", None)
    assert getattr(message, "reasoning", None) == reasoning
    return reasoning, message.content


def _openai_chat_streamed(served, **options) -> tuple[str, str]:
    stream = served.openai().chat.completions.create(
        model="m", messages=ASK, stream=True, **options
    )
    reasoning, content = [], []
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning.append(getattr(delta, "reasoning_content", None) or "")
            content.append(delta.content or "")
    return "".join(reasoning), "".join(content)


@pytest.mark.parametrize("model", ["thinker", "opener"])
def test_openai_chat_reasoning_content(model, request):
    served = request.getfixturevalue(model)
    assert _openai_chat(served) == ("Hmm.", "Paris")
    assert _openai_chat_streamed(served) == ("Hmm.", "Paris")


def test_openai_chat_thinking_switched_off_has_no_reasoning(thinker, opener):
    for served in (thinker, opener):
        assert _openai_chat(served, reasoning_effort="none") == (None, "Paris")


@pytest.mark.parametrize("model", ["thinker", "opener"])
def test_responses_reasoning_item_before_the_message(model, request):
    client = request.getfixturevalue(model).openai()
    reply = client.responses.create(model="m", input=ASK)
    reasoning, message = reply.output
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert [part.text for part in reasoning.content] == ["Hmm."]
    assert message.type == "message" and reply.output_text == "Paris"
    thinking_tokens = 3 if model == "thinker" else 2  # <think> was the prompt's
    assert reply.usage.output_tokens_details.reasoning_tokens == thinking_tokens

    with client.responses.stream(model="m", input=ASK) as stream:
        events = list(stream)
        streamed = stream.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == "Hmm."
    done = [e for e in events if e.type == "response.reasoning_text.done"]
    assert [e.text for e in done] == ["Hmm."] and done[0].output_index == 0
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert [i.type for i in streamed.output] == ["reasoning", "message"]
    assert streamed.output[0].content[0].text == "Hmm." and streamed.output_text == "Paris"


def test_responses_thinking_cut_by_max_output_tokens_is_incomplete(thinker):
    """Cut inside its thought, the reasoning item is the one cut: `incomplete`, as a cut
    message is (OpenAI's types allow it on reasoning items too)."""
    client = thinker.openai()
    reply = client.responses.create(model="m", input=ASK, max_output_tokens=2)
    assert [(i.type, i.status) for i in reply.output] == [("reasoning", "incomplete")]
    with client.responses.stream(model="m", input=ASK, max_output_tokens=2) as stream:
        events = list(stream)
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.type, i.status) for i in done] == [("reasoning", "incomplete")]
    assert events[-1].type == "response.incomplete"


def _anthropic(served, **options):
    return served.anthropic().messages.create(model="m", messages=ASK, max_tokens=16, **options)


@pytest.mark.parametrize("model", ["thinker", "opener"])
def test_anthropic_thinking_block_before_the_text(model, request):
    served = request.getfixturevalue(model)
    thinking, text = _anthropic(served).content
    assert (thinking.type, thinking.thinking, thinking.signature) == ("thinking", "Hmm.", "")
    assert (text.type, text.text) == ("text", "Paris")

    with served.anthropic().messages.stream(model="m", messages=ASK, max_tokens=16) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text"]
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert [d.type for d in deltas] == ["thinking_delta", "text_delta"]
    assert [(e.index, e.type) for e in events if e.type.startswith("content_block")] == [
        (0, "content_block_start"),
        (0, "content_block_delta"),
        (0, "content_block_stop"),
        (1, "content_block_start"),
        (1, "content_block_delta"),
        (1, "content_block_stop"),
    ]
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "Hmm." and final.content[1].text == "Paris"


def test_anthropic_thinking_disabled_has_no_thinking_block(thinker):
    blocks = _anthropic(thinker, extra_body={"thinking": {"type": "disabled"}}).content
    assert [(b.type, b.text) for b in blocks] == [("text", "Paris")]


@pytest.mark.parametrize("model", ["thinker", "opener"])
def test_ollama_thinking_fields(model, request):
    client = ollama.Client(host=request.getfixturevalue(model).url)
    for think in (True, None):  # Ollama's default for a thinking model is on
        reply = client.chat(model="m", messages=ASK, think=think)
        assert (reply.message.thinking, reply.message.content) == ("Hmm.", "Paris")
    chunks = list(client.chat(model="m", messages=ASK, think=True, stream=True))
    assert "".join(c.message.thinking or "" for c in chunks) == "Hmm."
    assert "".join(c.message.content for c in chunks) == "Paris"
    assert chunks[-1].done
    generated = client.generate(model="m", prompt="Capital of France?", think=True)
    assert (generated.thinking, generated.response) == ("Hmm.", "Paris")
    parts = list(client.generate(model="m", prompt="Capital of France?", stream=True))
    assert "".join(p.thinking or "" for p in parts) == "Hmm."
    assert "".join(p.response for p in parts) == "Paris"
    assert "thinking" in client.show("m").capabilities


def test_ollama_think_false_leaves_the_text_as_generated(opener):
    """`think: false` turns the template's switch off; what the model writes anyway stays in
    the content, as Ollama leaves it."""
    client = ollama.Client(host=opener.url)
    raw = client.generate(model="m", prompt="<|im_start|>assistant\n", raw=True, think=False)
    assert (raw.thinking, raw.response) == (None, "<think>Hmm.</think>Paris")
    reply = client.chat(model="m", messages=ASK, think=False)
    assert (reply.message.thinking, reply.message.content) == (None, "Paris")


def test_ollama_thinking_sent_back_reaches_the_template(caller):
    client = ollama.Client(host=caller.url)
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    turn = {"role": "assistant", "content": "Let", "tool_calls": [call]}
    result = {"role": "tool", "content": "sunny", "tool_name": "get_weather"}

    def prompt_tokens(assistant: dict) -> int:
        options = {"num_predict": 1}
        reply = client.chat(model="m", messages=[*ASK, assistant, result], options=options)
        return reply.prompt_eval_count

    assert prompt_tokens({**turn, "thinking": "Hmm."}) == prompt_tokens(turn) + 3


def test_tool_calls_after_the_thinking(caller):
    client = caller.openai()
    options = {"model": "m", "messages": ASK, "tools": [WEATHER]}
    message = client.chat.completions.create(**options).choices[0].message
    assert (message.reasoning_content, message.content) == ("Hmm.", "Let")
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    reasoning, text, calls = "", "", []
    for chunk in client.chat.completions.create(**options, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None:
            reasoning += getattr(delta, "reasoning_content", None) or ""
            text += delta.content or ""
            calls += delta.tool_calls or []
    assert (reasoning, text) == ("Hmm.", "Let") and calls[0].function.name == "get_weather"
    reply = caller.anthropic().messages.create(
        model="m", messages=ASK, max_tokens=64, tools=ANTHROPIC_TOOLS
    )
    assert [b.type for b in reply.content] == ["thinking", "text", "tool_use"]
    assert reply.stop_reason == "tool_use"


def test_structured_output_is_the_answer_even_after_an_opened_thought(opener):
    """A grammar keeps the output to its form from the first token: no thinking to split,
    though the prompt opened a thought."""
    options = {"response_format": {"type": "json_object"}, "max_tokens": 8}
    reasoning, content = _openai_chat(opener, **options)
    assert reasoning is None and content.startswith("{")


def test_a_model_without_thinking_tags_is_untouched(unthinking):
    assert _openai_chat(unthinking) == (None, "<think>Paris")
    assert _openai_chat_streamed(unthinking) == ("", "<think>Paris")
    assert [b.type for b in _anthropic(unthinking).content] == ["text"]
    reply = unthinking.openai().responses.create(model="m", input=ASK)
    assert [i.type for i in reply.output] == ["message"]
    assert "thinking" not in ollama.Client(host=unthinking.url).show("m").capabilities


def test_a_text_completion_keeps_the_tags(thinker):
    reply = thinker.openai().completions.create(
        model="m", prompt="<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert reply.choices[0].text == "<think>Hmm.</think>Paris"


def _cached_after_first(served, first: list[dict], then) -> int:
    """The prompt tokens the cache supplies to `then()`, a request sent right after the one
    for `first` (sent again, so that the cache holds its prompt and reply)."""
    served.openai().chat.completions.create(model="m", messages=first, tools=[WEATHER])
    return then()


def test_thinking_sent_back_keeps_the_tool_loop_in_the_cache(caller):
    """Qwen3's template renders the thinking of the current tool loop's turns: sent back,
    the next prompt matches what was generated up to the call (rendered with spaces)."""
    ask = [{"role": "user", "content": "Weather in Rome?"}]
    first = caller.openai().chat.completions.create(model="m", messages=ask, tools=[WEATHER])
    message = first.choices[0].message
    call = message.tool_calls[0]
    result = {"role": "tool", "tool_call_id": call.id, "content": "sunny"}
    turn = {"role": "assistant", "content": message.content, "tool_calls": [call.model_dump()]}
    with_thinking = {**turn, "reasoning_content": message.reasoning_content}

    def openai_turn(assistant: dict) -> int:
        reply = caller.openai().chat.completions.create(
            model="m", messages=[*ask, assistant, result], tools=[WEATHER]
        )
        return reply.usage.prompt_tokens_details.cached_tokens

    def anthropic_turn() -> int:
        assistant = {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": message.reasoning_content, "signature": ""},
                {"type": "text", "text": message.content},
                {"type": "tool_use", "id": call.id, "name": call.function.name,
                 "input": json.loads(call.function.arguments)},
            ],
        }  # fmt: skip
        tool_result = {"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}
        reply = caller.anthropic().messages.create(
            model="m",
            max_tokens=64,
            tools=ANTHROPIC_TOOLS,
            messages=[*ask, assistant, {"role": "user", "content": [tool_result]}],
        )
        return reply.usage.cache_read_input_tokens

    kept = _cached_after_first(caller, ask, lambda: openai_turn(with_thinking))
    lost = _cached_after_first(caller, ask, lambda: openai_turn(turn))
    # <think> Hmm. </think> Let <tool_call>, after the assistant turn's header
    assert kept == lost + 5 and lost >= first.usage.prompt_tokens
    assert _cached_after_first(caller, ask, anthropic_turn) == kept


def test_responses_reasoning_comes_back_into_the_prompt(caller):
    client = caller.openai()
    tools = [{"type": "function", **WEATHER["function"]}]
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    first = client.responses.create(model="m", input=ask, tools=tools)
    assert [i.type for i in first.output] == ["reasoning", "message", "function_call"]
    call = first.output[-1]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "cold"}
    items = [item.model_dump(exclude_none=True) for item in first.output]

    def cached(**request) -> int:
        client.responses.create(model="m", input=ask, tools=tools)  # the cache holds it again
        reply = client.responses.create(model="m", tools=tools, **request)
        return reply.usage.input_tokens_details.cached_tokens

    stored = cached(previous_response_id=first.id, input=[output])
    sent = cached(input=[*ask, *items, output])
    without = cached(input=[*ask, *[i for i in items if i["type"] != "reasoning"], output])
    assert stored == sent == without + 5
