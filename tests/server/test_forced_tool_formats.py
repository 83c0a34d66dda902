"""A forced call (`tool_choice`) in tool-call formats other than Hermes JSON between markers:
Mistral's two (`name[ARGS]{...}` and a JSON list after `[TOOL_CALLS]`) and Kimi K2's, each from
a factory model whose chat template uses it (mlx-lm picks its parser from the template), so the
call is written in that format and read back by mlx-lm's parser; a format whose arguments are
not one JSON value (Qwen3-Coder's XML parameters) gets a bare JSON call instead."""

from __future__ import annotations

import json
import re
from typing import Literal

import pytest
from pydantic import ConfigDict, create_model

from mlxkv import Runner
from mlxkv.models.loading import load_model
from mlxkv.server.anthropic_api.tool_ids import model_id
from mlxkv.testing.factory import TOOLS_CHAT_TEMPLATE
from tests.server.conftest import build_template_model, serve
from tests.server.test_forced_tool_calls import ANTHROPIC_TOOLS, ASK, CHAT_TOOLS, VALID, ZONE

_TURNS = (
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' %}[INST]{{ message.content }}[/INST]"
    "{% elif message.role == 'assistant' and message.tool_calls %}CALLS<|im_end|>"
    "{% elif message.role == 'assistant' %}{{ message.content }}<|im_end|>"
    "{% elif message.role == 'tool' %}RESULTS"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}\n{% endif %}"
)
_RESULTS = "[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]"


def _template(calls: str, results: str = _RESULTS) -> str:
    return _TURNS.replace("CALLS", calls).replace("RESULTS", results)


# Mistral Small 3.2 / Devstral: one `[TOOL_CALLS]name[ARGS]{...}` a call.
MISTRAL_ARGS = _template(
    "{% for call in message.tool_calls %}[TOOL_CALLS]{{ call.function.name }}[ARGS]"
    "{{ call.function.arguments | tojson }}{% endfor %}",
)
# Mistral 7B v0.3 / Nemo: `[TOOL_CALLS]` then a JSON list of calls, each with its id; the
# published template's id checks (tokenizer_config.json), which refuse any id but 9 characters.
_NINE = (
    "{% if not ID is defined or ID|length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{% endif %}"
)
MISTRAL_JSON = _template(
    "[TOOL_CALLS][{% for tool_call in message.tool_calls %}"
    "{% set out = tool_call.function|tojson %}{{ out[:-1] }}"
    + _NINE.replace("ID", "tool_call.id")
    + "{{ ', \"id\": \"' + tool_call.id + '\"}' }}"
    "{% if not loop.last %}, {% else %}]{% endif %}{% endfor %}",
    '[TOOL_RESULTS] {"content": {{ message.content }}, '
    + _NINE.replace("ID", "message.tool_call_id")
    + '"call_id": "{{ message.tool_call_id }}"}[/TOOL_RESULTS]',
)
# Kimi K2: calls in a section, each with its id `functions.NAME:INDEX` as the model wrote it;
# a result names the call by that id (the published template renders both as given).
KIMI = _template(
    "<|tool_calls_section_begin|>{% for call in message.tool_calls %}<|tool_call_begin|>"
    "{{ call.id }}<|tool_call_argument_begin|>{{ call.function.arguments | tojson }}"
    "<|tool_call_end|>{% endfor %}<|tool_calls_section_end|>",
    "## Return of {{ message.tool_call_id }}\n{{ message.content }}<|im_end|>",
)
# Qwen3-Coder: XML parameters, each value typed by the parser's reading of the schema.
QWEN3_CODER = _template(
    "{% for call in message.tool_calls %}<tool_call>\n<function={{ call.function.name }}>\n"
    "</function>\n</tool_call>{% endfor %}",
)


def _served(tmp_path, template: str):
    path = build_template_model(tmp_path / "model", ("Sunny", "today"), template)
    return serve(Runner(load_model(path), max_context=1024))


@pytest.mark.parametrize(
    ("template", "parser"),
    [(MISTRAL_ARGS, "mistral"), (MISTRAL_JSON, "mistral"), (KIMI, "kimi_k2")],
    ids=["mistral-args", "mistral-json", "kimi-k2"],
)
def test_a_forced_call_in_the_models_own_format(tmp_path, template, parser):
    with _served(tmp_path, template) as served:
        tokenizer = served.runner.tokenizer
        assert tokenizer.tool_parser.__module__ == f"mlx_lm.tool_parsers.{parser}"
        client = served.openai()
        options = {"model": "m", "messages": ASK, "tools": CHAT_TOOLS, "max_tokens": 200}
        required = client.chat.completions.create(**options, tool_choice="required")
        (call,) = required.choices[0].message.tool_calls
        assert call.function.name in VALID and required.choices[0].finish_reason == "tool_calls"
        assert json.loads(call.function.arguments) in VALID[call.function.name]
        named = {"type": "function", "function": {"name": "get_time"}}
        chunks = list(client.chat.completions.create(**options, tool_choice=named, stream=True))
        (streamed,) = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
        assert streamed.function.name == "get_time"
        reply = served.anthropic().messages.create(
            model="m", messages=ASK, tools=ANTHROPIC_TOOLS, max_tokens=200,
            tool_choice={"type": "tool", "name": "get_weather"},
        )  # fmt: skip
        (block,) = reply.content
        assert block.name == "get_weather" and block.input in VALID["get_weather"]


MISTRAL_CALL_IDS = MISTRAL_ARGS.replace("[ARGS]", "[CALL_ID]{{ call.id }}[ARGS]")


@pytest.mark.parametrize(
    ("template", "name"),
    [
        # arguments written as typed text, not JSON: no grammar for them
        (QWEN3_CODER, "get_time"),
        # mlx-lm reads the name before `[ARGS]` as `[\\w-]+`: `ns.get_time` would be
        # written and never read back
        (MISTRAL_ARGS, "ns.get_time"),
        # `[CALL_ID]` between the name and `[ARGS]`: mlx-lm's parser would read the id as
        # the name
        (MISTRAL_CALL_IDS, "get_time"),
    ],
    ids=["typed-text-arguments", "name-mistral-args-cannot-carry", "mistral-call-ids"],
)
def test_a_format_that_cannot_be_forced_gives_a_bare_json_call(tmp_path, template, name):
    """Written as `{"name": ..., "arguments": ...}` rather than in a format whose reading
    back the grammar cannot promise; the client gets the call all the same."""
    tools = [{"type": "function", "function": {"name": name, "parameters": ZONE}}]
    with _served(tmp_path, template) as served:
        reply = served.openai().chat.completions.create(
            model="m", messages=ASK, tools=tools, tool_choice="required", max_tokens=200
        )
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == name and reply.choices[0].finish_reason == "tool_calls"
    assert json.loads(call.function.arguments) in VALID["get_time"]


def _round_trip(call: dict, result_id: str) -> list[dict]:
    """ASK, the assistant's call as the client sends it back, and its result."""
    return ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": result_id, "content": '{"temperature": 21}'},
    ]


def test_mistral_json_calls_carry_the_id_its_template_takes_back(tmp_path):
    """Mistral 7B v0.3 / Nemo write each call's id (9 letters and digits); the client gets
    that id, and its next request (the result) passes the template's id checks, through the
    OpenAI and Anthropic APIs."""
    with _served(tmp_path, MISTRAL_JSON) as served:
        client = served.openai()
        options = {"model": "m", "tools": CHAT_TOOLS, "max_tokens": 200}
        reply = client.chat.completions.create(**options, messages=ASK, tool_choice="required")
        (call,) = reply.choices[0].message.tool_calls
        assert re.fullmatch("[A-Za-z0-9]{9}", call.id)
        written = served.runner.tokenizer.decode(served.runner.cache_tokens)
        assert re.search(f'"id": ?"{call.id}"', written)  # the model's own, not one made after
        history = _round_trip(call.model_dump(), call.id)
        after = client.chat.completions.create(**options, messages=history)
        assert after.choices[0].finish_reason in ("stop", "length")
        anthropic = served.anthropic()
        options = {"model": "m", "tools": ANTHROPIC_TOOLS, "max_tokens": 200}
        first = anthropic.messages.create(**options, messages=ASK, tool_choice={"type": "any"})
        (block,) = first.content
        assert re.fullmatch("[A-Za-z0-9]{9}", block.id)
        result = {"type": "tool_result", "tool_use_id": block.id, "content": "21"}
        history = ASK + [
            {"role": "assistant", "content": [block.model_dump()]},
            {"role": "user", "content": [result]},
        ]
        assert anthropic.messages.create(**options, messages=history).stop_reason


def _reused_past_the_id(served, cached: int) -> bool:
    """Whether the last request's first `cached` prompt tokens (reused from the cache) hold
    the first call's id as the model wrote it. (Not the whole reply: the factory model's
    arguments are compact JSON, which the template renders spaced.)"""
    reused = served.runner.tokenizer.decode(served.runner.cache_tokens[:cached])
    return "functions.get_time:0<|tool_call_argument_begin|>" in reused


def _forced_twice(served):
    """`get_time` forced on the first turn, sent back with its result, and forced again:
    the first call, the second turn's messages and its reply (the OpenAI client's)."""
    client = served.openai()
    options = {"model": "m", "tools": CHAT_TOOLS, "max_tokens": 200}
    named = {"type": "function", "function": {"name": "get_time"}}
    first = client.chat.completions.create(**options, messages=ASK, tool_choice=named)
    (call,) = first.choices[0].message.tool_calls
    history = _round_trip(call.model_dump(), call.id)
    second = client.chat.completions.create(**options, messages=history, tool_choice=named)
    return call, history, second


def test_kimi_ids_are_the_models_and_count_the_conversations_calls(tmp_path):
    """Kimi K2 writes `functions.NAME:INDEX`, INDEX counting the conversation's calls: the
    client gets that id, sends it back, and the next turn renders the call as the model wrote
    it (the cache reuses the reply past its id); a second forced call writes the next index."""
    with _served(tmp_path, KIMI) as served:
        call, _, second = _forced_twice(served)
        assert call.id == "functions.get_time:0"
        assert _reused_past_the_id(served, second.usage.prompt_tokens_details.cached_tokens)
        (again,) = second.choices[0].message.tool_calls
        assert again.id == "functions.get_time:1"


def test_kimi_ids_reach_anthropic_clients_valid_and_come_back_as_written(tmp_path):
    """Anthropic's tool_use ids allow only letters, digits, `_` and `-`: Kimi's id goes out in
    that form and comes back as the model wrote it (the next turn reuses the cached reply past
    the id)."""
    with _served(tmp_path, KIMI) as served:
        client = served.anthropic()
        options = {"model": "m", "tools": ANTHROPIC_TOOLS, "max_tokens": 200}
        forced = {"type": "tool", "name": "get_time"}
        first = client.messages.create(**options, messages=ASK, tool_choice=forced)
        (block,) = first.content
        assert re.fullmatch("[a-zA-Z0-9_-]+", block.id)
        result = {"type": "tool_result", "tool_use_id": block.id, "content": "21"}
        history = ASK + [
            {"role": "assistant", "content": [block.model_dump()]},
            {"role": "user", "content": [result]},
        ]
        second = client.messages.create(**options, messages=history, tool_choice=forced)
        assert _reused_past_the_id(served, second.usage.cache_read_input_tokens)
        (again,) = second.content
        assert model_id(again.id) == "functions.get_time:1"


def test_kimi_replies_differing_only_in_their_ids_each_take_their_own(tmp_path):
    """The same forced call, written `functions.get_time:0` in one conversation and `:1` in
    another (ids the model wrote, so in its token ids): the first conversation sent back
    again takes its own reply's ids, not the newer reply's, whose id no tool result there
    answers. Seen failing with the ids left out of `replies.call_reply_key` (`:1` taken)."""
    with _served(tmp_path, KIMI) as served:
        call, history, second = _forced_twice(served)
        (again,) = second.choices[0].message.tool_calls
        assert (again.id, again.function) == ("functions.get_time:1", call.function)
        served.openai().chat.completions.create(
            model="m", tools=CHAT_TOOLS, max_tokens=1, messages=history
        )
        prompt = served.runner.tokenizer.decode(served.runner.cache_tokens)
    compact = json.dumps(json.loads(call.function.arguments), separators=(",", ":"))
    # as the model wrote it: its id, and its arguments without the template's spaces
    assert f"{call.id}<|tool_call_argument_begin|>{compact}<|tool_call_end|>" in prompt


# Two models of one name: each tool's schema keeps it under `$defs/Place`.
_FORBID = ConfigDict(extra="forbid")  # no keys past the one a scripted model writes
_CityPlace = create_model("Place", __config__=_FORBID, city=(Literal["Paris", "Rome"], ...))
_ZonePlace = create_model("Place", __config__=_FORBID, zone=(Literal["UTC", "CET"], ...))
_Trip = create_model("Trip", __config__=_FORBID, place=(_CityPlace, ...))
_Clock = create_model("Clock", __config__=_FORBID, place=(_ZonePlace, ...))

_NESTED = {"plan_trip": _Trip, "set_clock": _Clock}


@pytest.mark.parametrize(
    "template",
    [TOOLS_CHAT_TEMPLATE, MISTRAL_JSON, MISTRAL_ARGS, KIMI, QWEN3_CODER],
    ids=["hermes-json", "mistral-json", "mistral-args", "kimi-k2", "bare-json"],
)
def test_tools_whose_parameters_refer_to_their_own_defs_can_be_forced(tmp_path, template):
    """A nested pydantic model's schema (what pydantic-ai, instructor and LangChain send)
    points into its own `$defs` from its root (`#/$defs/...`): still the tool's parameters
    once a call object wraps them, in any format; two tools' `$defs` of one name stay apart."""
    tools = [
        {"type": "function", "function": {"name": name, "parameters": model.model_json_schema()}}
        for name, model in _NESTED.items()
    ]
    assert all("Place" in tool["function"]["parameters"]["$defs"] for tool in tools)
    with _served(tmp_path, template) as served:
        client = served.openai()
        for choice in ("required", {"type": "function", "function": {"name": "set_clock"}}):
            reply = client.chat.completions.create(
                model="m", messages=ASK, tools=tools, tool_choice=choice, max_tokens=150
            )
            (call,) = reply.choices[0].message.tool_calls
            assert reply.choices[0].finish_reason == "tool_calls"
            _NESTED[call.function.name].model_validate_json(call.function.arguments)
