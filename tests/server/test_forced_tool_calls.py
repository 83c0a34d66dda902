"""A `tool_choice` that requires a call, through the real clients: the reply is a call in the
model's own format (a grammar keeps it there), with arguments that validate, even from a
model that would answer in text; a model with no call format writes it as a bare JSON object
kept by the grammar, and gets it back in each API's shape; "none" never returns a call."""

from __future__ import annotations

import json

import openai
import pytest

from mlxkv import Runner
from mlxkv.models.loading import load_model
from mlxkv.testing.factory import build_scripted_model
from tests.server.conftest import serve

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
ZONE = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
FUNCTIONS = [("get_weather", CITY), ("get_time", ZONE)]
CHAT_TOOLS = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in FUNCTIONS]
RESPONSES_TOOLS = [{"type": "function", "name": n, "parameters": p} for n, p in FUNCTIONS]
ANTHROPIC_TOOLS = [{"name": n, "input_schema": p} for n, p in FUNCTIONS]
VALID = {
    "get_weather": ({"city": "Paris"}, {"city": "Rome"}),
    "get_time": ({"zone": "UTC"}, {"zone": "CET"}),
}


@pytest.fixture(scope="module")
def texter(tmp_path_factory):
    """A model with a tool-call format (Hermes `<tool_call>` JSON) that answers in text."""
    path = build_scripted_model(tmp_path_factory.mktemp("texter") / "model", ("Sunny", "today"))
    with serve(Runner(load_model(path), max_context=1024)) as served:
        yield served


@pytest.fixture(scope="module")
def no_format(loaded_tiny):
    """A model whose template has no tool-call format (as SmolLM2)."""
    with serve(Runner(loaded_tiny("llama"), max_context=1024)) as served:
        yield served


def _valid(name: str, arguments: dict) -> bool:
    return arguments in VALID[name]


def test_openai_auto_answers_in_text(texter):
    reply = texter.openai().chat.completions.create(
        model="m", messages=ASK, tools=CHAT_TOOLS, max_tokens=20
    )
    assert reply.choices[0].message.content == "Sunnytoday"
    assert not reply.choices[0].message.tool_calls


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_openai_required_gives_a_call(texter, stream):
    client = texter.openai()
    options = {"model": "m", "messages": ASK, "tools": CHAT_TOOLS, "max_tokens": 200}
    if stream:
        chunks = list(
            client.chat.completions.create(**options, tool_choice="required", stream=True)
        )
        calls = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
        finish = chunks[-1].choices[0].finish_reason
        name, arguments = calls[0].function.name, calls[0].function.arguments
    else:
        reply = client.chat.completions.create(**options, tool_choice="required")
        finish = reply.choices[0].finish_reason
        (call,) = reply.choices[0].message.tool_calls
        name, arguments = call.function.name, call.function.arguments
    assert finish == "tool_calls"
    assert _valid(name, json.loads(arguments))


def test_openai_named_function_gives_that_call(texter):
    choice = {"type": "function", "function": {"name": "get_time"}}
    reply = texter.openai().chat.completions.create(
        model="m", messages=ASK, tools=CHAT_TOOLS, tool_choice=choice, max_tokens=200
    )
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    assert _valid("get_time", json.loads(call.function.arguments))


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_responses_required_and_named_give_calls(texter, stream):
    """Streamed, the response object in every event echoes the named tool_choice too."""
    client = texter.openai()
    named = {"type": "function", "name": "get_weather"}
    for choice, names in (("required", {"get_weather", "get_time"}), (named, {"get_weather"})):
        options = {
            "model": "m", "input": "weather?", "tools": RESPONSES_TOOLS, "tool_choice": choice,
            "max_output_tokens": 200,
        }  # fmt: skip
        if stream:
            with client.responses.stream(**options) as events:
                reply = events.get_final_response()
        else:
            reply = client.responses.create(**options)
        assert reply.tool_choice == choice or reply.tool_choice.name == "get_weather"
        (item,) = reply.output
        assert item.type == "function_call" and item.name in names


def test_anthropic_any_and_tool_give_tool_use(texter):
    client = texter.anthropic()
    named = {"type": "tool", "name": "get_weather"}
    for choice, names in (({"type": "any"}, {"get_weather", "get_time"}), (named, {"get_weather"})):
        reply = client.messages.create(
            model="m", messages=ASK, tools=ANTHROPIC_TOOLS, tool_choice=choice, max_tokens=200
        )
        (block,) = reply.content
        assert block.type == "tool_use" and block.name in names
        assert _valid(block.name, block.input) and reply.stop_reason == "tool_use"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_model_without_a_call_format_gives_calls_in_each_api(no_format, stream):
    """SmolLM2 and most small models have no tool-call format: the call is kept to a bare
    JSON object by the grammar and comes back in each API's shape, streamed or not."""
    client = no_format.openai()
    options = {"model": "m", "messages": ASK, "tools": CHAT_TOOLS, "max_tokens": 200}
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, names in (("required", set(VALID)), (named, {"get_time"})):
        if stream:
            chunks = list(
                client.chat.completions.create(**options, tool_choice=choice, stream=True)
            )
            (call,) = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
            finish = chunks[-1].choices[0].finish_reason
            assert not "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
        else:
            reply = client.chat.completions.create(**options, tool_choice=choice)
            (call,) = reply.choices[0].message.tool_calls
            finish = reply.choices[0].finish_reason
            assert not reply.choices[0].message.content
        assert call.function.name in names and finish == "tool_calls"
        assert _valid(call.function.name, json.loads(call.function.arguments))
    reply = client.responses.create(
        model="m", input="hi", tools=RESPONSES_TOOLS, tool_choice="required", stream=False,
        max_output_tokens=200,
    )  # fmt: skip
    (item,) = reply.output
    assert item.type == "function_call" and _valid(item.name, json.loads(item.arguments))
    anthropic_options = {
        "model": "m", "messages": ASK, "tools": ANTHROPIC_TOOLS, "max_tokens": 200,
        "tool_choice": {"type": "tool", "name": "get_weather"},
    }  # fmt: skip
    if stream:
        with no_format.anthropic().messages.stream(**anthropic_options) as events:
            message = events.get_final_message()
    else:
        message = no_format.anthropic().messages.create(**anthropic_options)
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "get_weather"
    assert _valid("get_weather", block.input) and message.stop_reason == "tool_use"


def test_a_forced_call_cut_by_max_tokens_comes_back_as_text(no_format):
    reply = no_format.openai().chat.completions.create(
        model="m", messages=ASK, tools=CHAT_TOOLS, tool_choice="required", max_tokens=3
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content.startswith("{")


def test_required_without_tools_is_a_400(texter):
    with pytest.raises(openai.BadRequestError, match="no tools"):
        texter.openai().chat.completions.create(
            model="m", messages=ASK, tool_choice="required", max_tokens=5
        )


# A tool without parameters, and one whose schema says nothing of other keys (JSON Schema
# allows them): the model may write only the listed ones, so the call ends.
OPEN_CITY = {key: value for key, value in CITY.items() if key != "additionalProperties"}
OPEN_FUNCTIONS = [("now", {"type": "object", "properties": {}}), ("get_weather", OPEN_CITY)]
OPEN_TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": p}} for n, p in OPEN_FUNCTIONS
]
OPEN_VALID = {"now": ({},), "get_weather": VALID["get_weather"]}


@pytest.mark.parametrize("name", ["now", "get_weather"])
def test_a_forced_call_writes_only_the_listed_arguments(no_format, name):
    """Else a small model adds keys (or, without parameters, nests the call again) until
    `max_tokens` and the call comes back as text (seen with SmolLM2)."""
    reply = no_format.openai().chat.completions.create(
        model="m", messages=ASK, tools=OPEN_TOOLS, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": name}},
    )  # fmt: skip
    (call,) = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == name
    assert json.loads(call.function.arguments) in OPEN_VALID[name]
