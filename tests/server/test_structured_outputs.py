"""Structured outputs through the real clients: OpenAI's `response_format` (chat) and
`text.format` (Responses), Anthropic's `output_config.format` (and the beta's `output_format`),
Ollama's `format`. The tiny
random model never writes this JSON on its own; every reply parses and validates, with
speculative decoding on in the server, and a schema that cannot compile is a 400 naming it."""

from __future__ import annotations

import json

import anthropic
import ollama
import openai
import pytest
from pydantic import BaseModel

from mlxkv import Runner
from tests.server.conftest import serve

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "sunny": {"type": "boolean"},
    },
    "required": ["city", "sunny"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Pick a city and say if it is sunny, as JSON."}]


@pytest.fixture(scope="module")
def served(loaded_tiny):
    runner = Runner(loaded_tiny("llama"), max_context=512, speculative="ngram")
    with serve(runner) as served:
        yield served


def _valid(text: str) -> bool:
    value = json.loads(text)
    return set(value) == {"city", "sunny"} and value["city"] in ("Paris", "Rome", "Oslo")


def test_openai_json_schema_and_json_object(served):
    client = served.openai()
    schema_format = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
    reply = client.chat.completions.create(
        model="m", messages=ASK, max_tokens=40, response_format=schema_format
    )
    assert _valid(reply.choices[0].message.content)
    anything = client.chat.completions.create(
        model="m", messages=ASK, max_tokens=40, response_format={"type": "json_object"},
        temperature=1.0, seed=5,
    )  # fmt: skip
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content), dict)


def test_responses_text_format(served):
    reply = served.openai().responses.create(
        model="m",
        input="Pick a city, as JSON.",
        max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "w", "schema": SCHEMA}},
    )
    assert _valid(reply.output_text)


def test_anthropic_output_config_format(served):
    reply = served.anthropic().messages.create(
        model="m",
        max_tokens=40,
        messages=ASK,
        extra_body={"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}},
    )
    assert _valid(reply.content[0].text)


def test_anthropic_beta_output_format(served):
    """The structured-outputs beta's spelling, a top-level `output_format`, as LiteLLM's
    `anthropic/` provider sends it: before, dropped, and the reply was plain text."""
    beta = {"anthropic-beta": "structured-outputs-2025-11-13"}
    client = served.anthropic()
    reply = client.messages.create(
        model="m", max_tokens=40, messages=ASK, extra_headers=beta,
        extra_body={"output_format": {"type": "json_schema", "schema": SCHEMA}},
    )  # fmt: skip
    assert _valid(reply.content[0].text)
    with pytest.raises(anthropic.BadRequestError, match="output_format.type"):
        client.messages.create(
            model="m", max_tokens=5, messages=ASK, extra_body={"output_format": {"type": "xml"}}
        )


def test_ollama_format(served):
    client = ollama.Client(host=served.url)
    reply = client.chat(model="m", messages=ASK, format=SCHEMA, options={"num_predict": 40})
    assert _valid(reply.message.content)


def test_a_schema_that_cannot_compile_is_a_400_naming_it(served):
    bad = {"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError, match="nonsense"):
        served.openai().chat.completions.create(
            model="m", messages=ASK, max_tokens=5, response_format=bad
        )
    with pytest.raises(anthropic.BadRequestError, match="json_schema"):
        served.anthropic().messages.create(
            model="m", max_tokens=5, messages=ASK,
            extra_body={"output_config": {"format": {"type": "xml"}}},
        )  # fmt: skip


@pytest.mark.parametrize(
    "response_format",
    [{"type": "json_schema", "json_schema": "w"}, {"type": "json_schema"}, {"type": "xml"}],
    ids=["schema-not-an-object", "no-schema", "unknown-type"],
)
def test_malformed_response_formats_are_400s(served, response_format):
    status, body = served.post(
        "/v1/chat/completions",
        {"messages": ASK, "max_tokens": 3, "response_format": response_format},
    )
    assert status == 400 and "response_format" in body["error"]["message"]


class Node(BaseModel):
    """A tree: its recursion ends in an empty list of children."""

    value: int
    children: list[Node]


def test_a_recursive_schema_that_can_end_gives_a_valid_tree(served):
    reply = served.openai().chat.completions.parse(
        model="m", messages=ASK, max_tokens=60, response_format=Node
    )
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(reply.choices[0].message.parsed, Node)


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "#"},
        {
            "type": "object",
            "properties": {"value": {"type": "integer"}, "child": {"$ref": "#"}},
            "required": ["value", "child"],
        },
        {"$ref": "#/$defs/node", "$defs": {"node": {"$ref": "#/$defs/node"}}},
    ],
    ids=["root-ref", "required-child", "defs-loop"],
)
def test_a_recursion_that_cannot_end_is_a_400_naming_the_ref(served, schema):
    """Such a schema compiles, but no finite JSON matches it: the reply was "" with "stop"."""
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    with pytest.raises(openai.BadRequestError, match=r"no finite value: '\$ref': '#"):
        served.openai().chat.completions.create(
            model="m", messages=ASK, max_tokens=20, response_format=fmt
        )


# 3,000 alternatives compile, but llguidance gives up once tokens come ("Current row has 3000
# items; max is 2000"); a bound past 64-bit integers does not convert at all.
_ALTERNATIVES = [
    {"type": "object", "properties": {f"k{i}": {"type": "string"}}, "required": [f"k{i}"]}
    for i in range(3000)
]


@pytest.mark.parametrize(
    ("schema", "mentions"),
    [
        ({"anyOf": _ALTERNATIVES}, "max is 2000"),
        ({"type": "integer", "minimum": -(10**300)}, "not JSON serializable"),
    ],
    ids=["given-up-mid-reply", "bound-past-int64"],
)
def test_a_schema_the_engine_cannot_follow_is_a_400_in_each_shape(served, schema, mentions):
    """Both were a 500 "internal error" with the traceback logged twice."""
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    status, body = served.post(
        "/v1/chat/completions", {"messages": ASK, "max_tokens": 8, "response_format": fmt}
    )
    assert status == 400 and mentions in body["error"]["message"], body
    output = {"format": {"type": "json_schema", "schema": schema}}
    status, body = served.post(
        "/v1/messages", {"messages": ASK, "max_tokens": 8, "output_config": output}
    )
    assert status == 400 and mentions in body["error"]["message"], body
    status, body = served.post("/api/chat", {"messages": ASK, "stream": False, "format": schema})
    assert status == 400 and mentions in body["error"], body
