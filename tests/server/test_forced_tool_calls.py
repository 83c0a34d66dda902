"""A `tool_choice` that requires a call, through the real clients: the reply is a call in the
model's own format (a grammar keeps it there), with arguments that validate, even from a
model that would answer in text; a model whose format cannot be forced is a 400 in each API's
shape, and "none" never returns a call."""

from __future__ import annotations

import json

import anthropic
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


def test_responses_required_and_named_give_calls(texter):
    client = texter.openai()
    named = {"type": "function", "name": "get_weather"}
    for choice, names in (("required", {"get_weather", "get_time"}), (named, {"get_weather"})):
        reply = client.responses.create(
            model="m", input="weather?", tools=RESPONSES_TOOLS, tool_choice=choice,
            max_output_tokens=200,
        )  # fmt: skip
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


def test_a_model_that_cannot_be_forced_is_a_400_in_each_api(no_format):
    client = no_format.openai()
    with pytest.raises(openai.BadRequestError, match="cannot be made to write") as raised:
        client.chat.completions.create(
            model="m", messages=ASK, tools=CHAT_TOOLS, tool_choice="required", max_tokens=5
        )
    assert raised.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError, match="cannot be made to write"):
        client.responses.create(
            model="m", input="hi", tools=RESPONSES_TOOLS, tool_choice="required"
        )
    with pytest.raises(anthropic.BadRequestError, match="cannot be made to write") as raised:
        no_format.anthropic().messages.create(
            model="m", messages=ASK, tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"},
            max_tokens=5,
        )  # fmt: skip
    assert raised.value.body["error"]["type"] == "invalid_request_error"
    assert no_format.runner.cache_info().num_tokens == 0  # refused before any work


def test_required_without_tools_is_a_400(texter):
    with pytest.raises(openai.BadRequestError, match="no tools"):
        texter.openai().chat.completions.create(
            model="m", messages=ASK, tool_choice="required", max_tokens=5
        )
