"""A reply with tool calls, sent back by the real clients as its text and parsed calls: the
next turn reuses the previous prompt and the whole reply, calls included, even where the
chat template writes the calls otherwise than the model did (the scripted model writes compact
JSON; the template renders `tojson`'s spaced form). The second turn's prompt is what the cache
holds plus the new messages, and its answer equals a fresh Runner's fed those ids."""

from __future__ import annotations

import json

import pytest

from mlxkv import Runner
from mlxkv.models.loading import load_model
from mlxkv.testing.factory import TOOLS_CHAT_TEMPLATE, build_scripted_model
from tests.runner.test_batching import _tokens_and_logprobs
from tests.server.conftest import SCRIPT, WEATHER, build_template_model, serve
from tests.tolerances import LOGPROB_ABS

ASK = [{"role": "user", "content": "Weather in Paris?"}]
RESULT = "Sunny, 21 C."
ANTHROPIC_TOOLS = [
    {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]},
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = build_scripted_model(tmp_path_factory.mktemp("tools") / "model", SCRIPT)
    with serve(Runner(load_model(path), max_context=512), model_name="m") as s:
        yield s


def _openai_turns(served, arguments: str | None = None) -> tuple[list[dict], int]:
    """The second turn's messages (the call sent back with `arguments` if given) and the
    tokens the cache held after the first turn."""
    client = served.openai()
    first = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], max_tokens=40)
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    held = len(served.runner.cache_tokens)
    calls = [call.model_dump() for call in message.tool_calls]
    if arguments is not None:
        calls[0]["function"]["arguments"] = arguments
    reply = {"role": "assistant", "content": message.content, "tool_calls": calls}
    result = {"role": "tool", "tool_call_id": calls[0]["id"], "content": RESULT}
    return [*ASK, reply, result], held


def test_openai_second_turn_reuses_the_whole_tool_call_reply(served):
    messages, held = _openai_turns(served)
    second = served.openai().chat.completions.create(
        model="m", messages=messages, tools=[WEATHER], max_tokens=2
    )
    assert second.usage.prompt_tokens_details.cached_tokens == held


def test_anthropic_streamed_second_turn_reuses_the_whole_tool_call_reply(served):
    client = served.anthropic()
    with client.messages.stream(
        model="m", messages=ASK, tools=ANTHROPIC_TOOLS, max_tokens=40
    ) as stream:
        first = stream.get_final_message()
    assert first.stop_reason == "tool_use"
    held = len(served.runner.cache_tokens)
    call = next(block for block in first.content if block.type == "tool_use")
    result = {"type": "tool_result", "tool_use_id": call.id, "content": RESULT}
    messages = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [result]},
    ]
    second = client.messages.create(
        model="m", messages=messages, tools=ANTHROPIC_TOOLS, max_tokens=2
    )
    assert second.usage.cache_read_input_tokens == held


def test_the_second_turn_is_the_cache_plus_the_new_messages_and_answers_as_a_fresh_runner(
    served,
):
    messages, _ = _openai_turns(served)
    held = list(served.runner.cache_tokens)
    runner = served.runner
    for call in messages[1]["tool_calls"]:  # as the server hands them to the chat template
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    ids = runner.encode(messages, tools=[WEATHER])
    assert ids[: len(held)] == held
    options = {"max_tokens": 4, "temperature": 0.0, "logprobs": 0}
    got = _tokens_and_logprobs(runner.stream(messages, tools=[WEATHER], **options))
    fresh = Runner(runner.loaded, max_context=512)
    want = _tokens_and_logprobs(fresh.stream(ids, **options))
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=LOGPROB_ABS)


def test_calls_sent_back_otherwise_render_from_the_template(served):
    """Other arguments than the model wrote: not its reply, so the template writes the call
    and the cache is reused up to where the prompts part."""
    messages, held = _openai_turns(served, arguments=json.dumps({"city": "Rome"}))
    second = served.openai().chat.completions.create(
        model="m", messages=messages, tools=[WEATHER], max_tokens=2
    )
    assert second.usage.prompt_tokens_details.cached_tokens < held


def test_a_template_that_wants_tool_results_after_calls_renders_the_reply_from_itself(
    tmp_path,
):
    """A known call reply renders without its calls around its ids; a template that refuses
    a tool result after a message without calls (as Mistral's do) gets the messages as sent,
    rendered as before: the turn is answered, the cache reused up to where the prompts part."""
    strict = TOOLS_CHAT_TEMPLATE.replace(
        "{% elif message['role'] == 'tool' %}",
        "{% elif message['role'] == 'tool' %}"
        "{% if not messages[loop.index0 - 1].tool_calls %}"
        "{{ raise_exception('tool results must follow tool calls') }}{% endif %}",
    )
    assert strict != TOOLS_CHAT_TEMPLATE
    path = build_template_model(tmp_path / "strict", SCRIPT, strict)
    with serve(Runner(load_model(path), max_context=512), model_name="m") as served:
        messages, held = _openai_turns(served)
        second = served.openai().chat.completions.create(
            model="m", messages=messages, tools=[WEATHER], max_tokens=2
        )
    assert 0 < second.usage.prompt_tokens_details.cached_tokens < held


def test_anthropic_prefilled_tool_call_reply_sent_back_is_reused_in_full(served):
    """A prefill the model continues with a call (`Let`, then the scripted call): the client
    sends back the prefill's text and the call, which take the prefill's and the reply's ids."""
    client = served.anthropic()
    prefilled = [*ASK, {"role": "assistant", "content": "Let"}]
    first = client.messages.create(
        model="m", messages=prefilled, tools=ANTHROPIC_TOOLS, max_tokens=40
    )
    assert first.stop_reason == "tool_use"
    held = len(served.runner.cache_tokens)
    blocks = [b.model_dump() for b in first.content]
    call = next(block for block in blocks if block["type"] == "tool_use")
    texts = [block["text"] for block in blocks if block["type"] == "text"]
    sent = [{"type": "text", "text": "Let" + "".join(texts)}, call]
    result = {"type": "tool_result", "tool_use_id": call["id"], "content": RESULT}
    messages = [*ASK, {"role": "assistant", "content": sent}, {"role": "user", "content": [result]}]
    second = client.messages.create(
        model="m", messages=messages, tools=ANTHROPIC_TOOLS, max_tokens=2
    )
    assert second.usage.cache_read_input_tokens == held
