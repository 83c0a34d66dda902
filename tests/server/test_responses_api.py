"""OpenAI's Responses API through the real `openai` client: answers plain and streamed (the
events Codex reads), tool calls out and their results back in, `previous_response_id`, and
the cache reused across turns."""

from __future__ import annotations

import json

import openai
import pytest

from mlxkv import Runner
from mlxkv.models.loading import load_model
from tests.server.conftest import TOOL_CALL, serve

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
INSTRUCTIONS = "You are a weather assistant. Answer briefly."


@pytest.fixture(scope="module")
def scripted_server(scripted_dir):
    with serve(Runner(load_model(scripted_dir), max_context=2048)) as served:
        yield served


def test_a_reply_with_a_tool_call(scripted_server):
    client = scripted_server.openai()
    reply = client.responses.create(
        model="m", instructions=INSTRUCTIONS, input="Weather in Paris?", tools=[WEATHER]
    )
    assert reply.status == "completed" and reply.output_text == "Let"
    message, call = reply.output
    assert message.type == "message" and call.type == "function_call"
    assert message.status == call.status == "completed"
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == json.loads(TOOL_CALL)["arguments"]
    assert reply.usage.input_tokens > 0 and reply.usage.output_tokens > 0


def test_streamed_events_build_the_same_response(scripted_server):
    client = scripted_server.openai()
    kwargs = {"model": "m", "instructions": INSTRUCTIONS, "input": "Weather?", "tools": [WEATHER]}
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        streamed = stream.get_final_response()
    kinds = [event.type for event in events]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    assert "response.function_call_arguments.done" in kinds
    assert kinds.count("response.output_item.done") == 2
    plain = client.responses.create(**kwargs)
    assert [i.type for i in streamed.output] == [i.type for i in plain.output]
    assert streamed.output_text == plain.output_text
    assert streamed.output[1].arguments == plain.output[1].arguments


def test_the_tool_result_turn_reuses_the_first_turn(scripted_server):
    """What Codex does each turn: the same instructions, the conversation so far (here by
    previous_response_id), the tool's output."""
    client = scripted_server.openai()
    first = client.responses.create(
        model="m", instructions=INSTRUCTIONS, input="Weather in Rome?", tools=[WEATHER]
    )
    call = first.output[-1]
    second = client.responses.create(
        model="m",
        instructions=INSTRUCTIONS,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=[WEATHER],
    )
    assert second.status == "completed"
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


@pytest.mark.parametrize("streamed", [False, True], ids=["plain", "streamed"])
def test_an_item_reference_is_the_reply_it_names(scripted_server, streamed):
    """The AI SDK's `openai` provider (ai 6.0, @ai-sdk/openai 3.0, `store` on) sends an earlier
    reply back as `item_reference`s to its output items: the turn is the one its text and call
    make, and reuses the first turn's prompt and reply (a reference dropped left them out)."""
    client = scripted_server.openai()
    kwargs = {"model": "m", "instructions": INSTRUCTIONS, "tools": [WEATHER]}
    ask = {"role": "user", "content": "Weather in Lima?"}
    if streamed:
        with client.responses.stream(input=[ask], **kwargs) as stream:
            first = stream.get_final_response()
    else:
        first = client.responses.create(input=[ask], **kwargs)
    message, call = first.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "warm"}
    referenced = [ask, *({"type": "item_reference", "id": item.id} for item in first.output)]
    inline = [ask, message.model_dump(), call.model_dump()]
    by_reference = client.responses.create(input=[*referenced, result], **kwargs)
    by_text = client.responses.create(input=[*inline, result], **kwargs)
    assert by_reference.usage.input_tokens == by_text.usage.input_tokens
    reused = first.usage.input_tokens + first.usage.output_tokens
    assert by_reference.usage.input_tokens_details.cached_tokens >= reused


def test_input_items_as_codex_sends_them(scripted_server):
    client = scripted_server.openai()
    reply = client.responses.create(
        model="m",
        instructions=INSTRUCTIONS,
        input=[
            {"type": "message", "role": "developer", "content": [
                {"type": "input_text", "text": "Sandbox: read-only."}]},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "Weather?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call", "name": "get_weather", "arguments": '{"city": "Oslo"}',
             "call_id": "call_1"},
            {"type": "function_call_output", "call_id": "call_1", "output": "cold"},
            {"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": "It is cold."}]},
            {"type": "message", "role": "user", "content": "And now?"},
        ],
        tools=[
            {"type": "namespace", "name": "weather", "tools": [WEATHER]},
            {"type": "web_search"},
            {"type": "custom", "name": "apply_patch"},
        ],
        tool_choice="auto",
        parallel_tool_calls=False,
        store=False,
        extra_body={"include": ["reasoning.encrypted_content"], "reasoning": {"effort": "low"},
                    "prompt_cache_key": "session-1"},
    )  # fmt: skip
    assert reply.output[-1].type == "function_call"  # the namespace's function was offered


@pytest.mark.parametrize(
    ("body", "mentions"),
    [
        ({"input": [{"type": "message", "role": "user",
                     "content": [{"type": "input_image", "image_url": "x"}]}]}, "take images"),
        ({"input": "hi", "previous_response_id": "resp_unknown"}, "not found"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{oops",
                     "call_id": "c"}]}, "not JSON"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": [{"type": "item_reference", "id": "msg_unknown"}]}, "not found"),
    ],
    ids=["image", "unknown-previous", "bad-arguments", "zero-max", "unknown-item"],
)  # fmt: skip
def test_bad_requests_are_400s_in_openai_shape(scripted_server, body, mentions):
    with pytest.raises(openai.BadRequestError) as raised:
        scripted_server.openai().responses.create(model="m", **body)
    assert mentions in raised.value.body["message"]


def test_store_false_is_not_kept_for_previous_response_id(scripted_server):
    client = scripted_server.openai()
    reply = client.responses.create(model="m", input="Weather?", store=False)
    with pytest.raises(openai.BadRequestError, match="not found"):
        client.responses.create(model="m", input="And?", previous_response_id=reply.id)


def test_a_reply_cut_by_max_output_tokens_ends_incomplete(scripted_server):
    """The message it cut is `incomplete` too, in the stream's output_item.done and in the
    response, as OpenAI sends it (a captured gpt-5-nano stream cut by max_output_tokens);
    it said `completed`."""
    client = scripted_server.openai()
    kwargs = {"model": "m", "input": "Weather?", "tools": [WEATHER], "max_output_tokens": 1}
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete"
    done = [event.item for event in events if event.type == "response.output_item.done"]
    assert [(item.type, item.status) for item in done] == [("message", "incomplete")]
    assert events[-1].response.output[-1].status == "incomplete"
    reply = client.responses.create(**kwargs)
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert [(item.type, item.status) for item in reply.output] == [("message", "incomplete")]
