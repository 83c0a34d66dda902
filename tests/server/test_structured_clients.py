"""Typed output as the client libraries ask for it by default, on a model with no tool-call
format (as SmolLM2): each request is the body the library sends (pydantic-ai's typed output,
instructor's TOOLS mode, LangChain's `with_structured_output` on ChatOpenAI and ChatAnthropic,
LiteLLM's `anthropic/` provider with `response_format`, smolagents' and the Agents SDK's
`required`), and its arguments are read back as the library does, with its pydantic model.
The models' fields are bounded (Literal, ranges, short lists, no other keys): the random model
would otherwise fill a string until max_tokens; tests/real_model has free-text fields."""

from __future__ import annotations

import json
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field

from mlxkv import Runner
from tests.server.conftest import serve

ASK = [{"role": "user", "content": "Tell me about a city."}]


class CityInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: Literal["Paris", "Rome", "Lima"]
    population_millions: int = Field(ge=0, le=40)
    coastal: bool


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Literal["Ada", "Alan"]
    age: int = Field(ge=0, le=120)
    languages: list[Literal["en", "fr"]] = Field(max_length=2)


@pytest.fixture(scope="module")
def served(loaded_tiny):
    with serve(Runner(loaded_tiny("llama"), max_context=1024)) as s:
        yield s


def _openai_call(served, body: dict) -> tuple[str, dict]:
    status, reply = served.post("/v1/chat/completions", {"model": "m", "max_tokens": 300, **body})
    assert status == 200, reply
    (choice,) = reply["choices"]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    return call["function"]["name"], json.loads(call["function"]["arguments"])


def test_pydantic_ai_typed_output(served):
    """pydantic-ai's default output: a `final_result` tool, strict, and `required`."""
    parameters = {**CityInfo.model_json_schema(), "additionalProperties": False}
    tool = {
        "type": "function",
        "function": {
            "name": "final_result",
            "description": "The final response which ends this conversation",
            "parameters": parameters,
            "strict": True,
        },
    }
    body = {"messages": ASK, "n": 1, "tools": [tool], "tool_choice": "required", "stream": False}
    name, arguments = _openai_call(served, body)
    assert name == "final_result"
    CityInfo.model_validate(arguments)


@pytest.mark.parametrize("library", ["instructor", "langchain-openai"])
def test_a_named_function(served, library):
    """instructor's TOOLS mode and LangChain's ChatOpenAI `function_calling`: one tool named
    in tool_choice (LangChain also turns off parallel calls)."""
    tool = {
        "type": "function",
        "function": {
            "name": "Person",
            "description": "Correctly extracted `Person` with all the required parameters",
            "parameters": Person.model_json_schema(),
        },
    }
    body = {"messages": ASK, "tools": [tool]}
    body["tool_choice"] = {"type": "function", "function": {"name": "Person"}}
    if library == "langchain-openai":
        body["parallel_tool_calls"] = False
    name, arguments = _openai_call(served, body)
    assert name == "Person"
    Person.model_validate(arguments)


@pytest.mark.parametrize(
    ("library", "tool_name"),
    [("langchain-anthropic", "Person"), ("litellm-anthropic", "json_tool_call")],
)
def test_anthropic_tool_choice_tool(served, library, tool_name):
    """LangChain's ChatAnthropic `with_structured_output`, and LiteLLM's `anthropic/` with a
    `response_format` (it sends the schema as a `json_tool_call` tool)."""
    tool = {
        "name": tool_name,
        "description": "A person.",
        "input_schema": Person.model_json_schema(),
    }
    body = {
        "model": "m",
        "max_tokens": 300,
        "messages": ASK,
        "tools": [tool],
        "tool_choice": {"type": "tool", "name": tool_name},
    }
    status, reply = served.post("/v1/messages", body)
    assert status == 200, reply
    (block,) = reply["content"]
    assert block["type"] == "tool_use" and block["name"] == tool_name
    assert reply["stop_reason"] == "tool_use"
    Person.model_validate(block["input"])


def test_required_among_several_tools_streamed(served):
    """smolagents' ToolCallingAgent and the Agents SDK with `required`: several tools, any
    one of them, streamed."""
    tools = [
        {"type": "function", "function": {"name": name, "parameters": model.model_json_schema()}}
        for name, model in (("final_answer", CityInfo), ("lookup_person", Person))
    ]
    client = served.openai()
    chunks = list(
        client.chat.completions.create(
            model="m", messages=ASK, tools=tools, tool_choice="required", max_tokens=300,
            stream=True,
        )
    )  # fmt: skip
    deltas = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or []]
    name = deltas[0].function.name
    arguments = json.loads("".join(d.function.arguments or "" for d in deltas))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    {"final_answer": CityInfo, "lookup_person": Person}[name].model_validate(arguments)


def test_the_real_pydantic_ai_agent_gets_its_typed_output(served):
    """pydantic-ai itself (`pydantic-ai-slim[openai]`), its defaults: an Agent whose output
    is a pydantic model, over the OpenAI chat API."""
    agent_module = pytest.importorskip("pydantic_ai")
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=f"{served.url}/v1", api_key="unused")
    model = OpenAIChatModel("m", provider=provider)
    agent = agent_module.Agent(model, output_type=CityInfo, model_settings={"max_tokens": 300})
    result = agent.run_sync("Tell me about a city.")
    assert isinstance(result.output, CityInfo)


def test_responses_required_streamed(served):
    """The OpenAI Agents SDK's `tool_choice="required"` over the Responses API, streamed
    (`Runner.run_streamed`): the call arrives as a `function_call` item whose arguments
    validate."""
    tool = {"type": "function", "name": "lookup_person", "parameters": Person.model_json_schema()}
    events = list(
        served.openai().responses.create(
            model="m", input="Who?", tools=[tool], tool_choice="required", stream=True,
            max_output_tokens=300,
        )
    )  # fmt: skip
    (done,) = [e for e in events if e.type == "response.completed"]
    (item,) = done.response.output
    assert item.type == "function_call" and item.name == "lookup_person"
    Person.model_validate_json(item.arguments)


def test_an_integer_without_bounds_ends_where_the_model_would_write_digits(served, loaded_tiny):
    """pydantic-ai's `population: int` (no bounds) on SmolLM2 wrote `3121000000000...` until
    max_tokens, so no call was made (`finish_reason` "length"). A model that writes digits for
    ever (here one digit's logit raised) now gets the number ended at 16 digits, and the
    call validates. Seen failing without `bounded_integers`."""
    parameters = {
        "type": "object",
        "properties": {"population": {"type": "integer"}},
        "required": ["population"],
        "additionalProperties": False,
    }
    tool = {"type": "function", "function": {"name": "final_result", "parameters": parameters}}
    (three,) = loaded_tiny("llama").tokenizer.encode("3", add_special_tokens=False)
    body = {"messages": ASK, "tools": [tool], "tool_choice": "required", "temperature": 0}
    _, arguments = _openai_call(served, {**body, "logit_bias": {str(three): 100}})
    assert arguments == {"population": 3333333333333333}
