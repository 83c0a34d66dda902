"""The Messages API through the real `anthropic` client, against a fresh Runner as reference."""

from __future__ import annotations

import pytest

from mlxkv import Runner
from tests.server.conftest import TOOL_CALL, serve

QUESTION = [{"role": "user", "content": "Once upon a time there was"}]
SYSTEM = "You are terse."
TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


def _chat(system: str, messages: list[dict]) -> list[dict]:
    return [{"role": "system", "content": system}, *messages]


def test_message_equals_a_fresh_runner_and_counts_every_prompt_token(tiny_server, fresh_runner):
    reference = fresh_runner().generate(_chat(SYSTEM, QUESTION), max_tokens=12)
    out = tiny_server.anthropic().messages.create(
        model="claude-local", system=SYSTEM, messages=QUESTION, max_tokens=12
    )
    assert [block.type for block in out.content] == ["text"]
    assert out.content[0].text == reference.text
    assert out.stop_reason == ("max_tokens" if reference.finish_reason == "length" else "end_turn")
    prompt_tokens = len(fresh_runner().encode(_chat(SYSTEM, QUESTION)))
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == prompt_tokens
    assert out.usage.output_tokens == reference.generation_tokens


def test_system_blocks_equal_a_system_string(tiny_server):
    client = tiny_server.anthropic()
    blocks = [{"type": "text", "text": "You are"}, {"type": "text", "text": "terse."}]
    as_blocks = client.messages.count_tokens(model="m", system=blocks, messages=QUESTION)
    as_string = client.messages.count_tokens(
        model="m", system="You are\n\nterse.", messages=QUESTION
    )
    assert as_blocks.input_tokens == as_string.input_tokens


def test_stream_sends_the_standard_events_and_the_same_text(tiny_server, fresh_runner):
    reference = fresh_runner().generate(QUESTION, max_tokens=10)
    with tiny_server.anthropic().messages.stream(
        model="m", messages=QUESTION, max_tokens=10
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    raw = [k for k in kinds if k not in ("text", "input_json")]  # the SDK's own helper events
    assert raw[:2] == ["message_start", "content_block_start"]
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(raw[2:-3]) == {"content_block_delta"}
    assert final.content[0].text == reference.text
    assert final.usage.output_tokens == 10


def test_second_turn_reads_the_cache_and_equals_a_fresh_runner(tiny_server, fresh_runner):
    client = tiny_server.anthropic()
    first = client.messages.create(model="m", system=SYSTEM, messages=QUESTION, max_tokens=8)
    messages = [
        *QUESTION,
        {"role": "assistant", "content": first.content[0].text},
        {"role": "user", "content": [{"type": "text", "text": "And then?"}]},
    ]
    second = client.messages.create(model="m", system=SYSTEM, messages=messages, max_tokens=8)
    assert second.usage.cache_read_input_tokens > first.usage.input_tokens // 2
    as_runner = [*messages[:2], {"role": "user", "content": "And then?"}]
    reference = fresh_runner().generate(_chat(SYSTEM, as_runner), max_tokens=8)
    assert second.content[0].text == reference.text


def test_count_tokens_equals_the_runners_encoding(tiny_server, fresh_runner):
    counted = tiny_server.anthropic().messages.count_tokens(
        model="m", system=SYSTEM, messages=QUESTION
    )
    assert counted.input_tokens == len(fresh_runner().encode(_chat(SYSTEM, QUESTION)))


@pytest.fixture(scope="module")
def scripted_server(scripted_dir):
    with serve(Runner.load(scripted_dir)) as served:
        yield served


def test_tool_use_round_trip(scripted_server):
    client = scripted_server.anthropic()
    first = client.messages.create(model="m", messages=QUESTION, tools=TOOLS, max_tokens=10)
    assert first.stop_reason == "tool_use"
    text, call = first.content
    assert (text.type, text.text) == ("text", "Let")
    assert (call.type, call.name, call.input) == ("tool_use", "get_weather", {"city": "Paris"})
    messages = [
        *QUESTION,
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"},
            ],
        },
    ]
    counted = client.messages.count_tokens(model="m", messages=messages, tools=TOOLS)
    second = client.messages.create(model="m", messages=messages, tools=TOOLS, max_tokens=10)
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == counted.input_tokens
    assert second.usage.cache_read_input_tokens > 0
    as_runner = [
        *QUESTION,
        {
            "role": "assistant",
            "content": "Let",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    openai_tools = [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t["description"],
                "parameters": t["input_schema"],
            },
        }
        for t in TOOLS
    ]
    assert counted.input_tokens == len(scripted_server.runner.encode(as_runner, tools=openai_tools))


def test_streamed_tool_use_blocks(scripted_server):
    with scripted_server.anthropic().messages.stream(
        model="m", messages=QUESTION, tools=TOOLS, max_tokens=10
    ) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[1].input == {"city": "Paris"}
    assert final.stop_reason == "tool_use"


def test_stop_sequence_is_reported(scripted_server):
    out = scripted_server.anthropic().messages.create(
        model="m", messages=QUESTION, max_tokens=10, stop_sequences=["<tool_call>", "zzz"]
    )
    assert out.content[0].text == "Let"
    assert (out.stop_reason, out.stop_sequence) == ("stop_sequence", "<tool_call>")


def test_tool_choice_none_leaves_the_call_as_text(scripted_server):
    out = scripted_server.anthropic().messages.create(
        model="m", messages=QUESTION, tools=TOOLS, tool_choice={"type": "none"}, max_tokens=10
    )
    assert out.content[0].text == "Let<tool_call>" + TOOL_CALL + "</tool_call>"
    assert out.stop_reason == "end_turn"
