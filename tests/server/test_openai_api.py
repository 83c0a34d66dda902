"""The OpenAI endpoints through the real `openai` client, against a fresh Runner as reference."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from tests.server.conftest import TOOL_CALL, serve
from tests.tolerances import LOGPROB_ABS

QUESTION = [{"role": "user", "content": "Once upon a time there was"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def test_models_lists_the_loaded_model(tiny_server):
    models = tiny_server.openai().models.list().data
    assert [m.id for m in models] == [tiny_server.runner.loaded.path.name]


def test_chat_answer_equals_a_fresh_runner(tiny_server, fresh_runner):
    reference = fresh_runner().generate(QUESTION, max_tokens=12)
    out = tiny_server.openai().chat.completions.create(
        model="gpt-4o", messages=QUESTION, max_tokens=12
    )
    assert out.choices[0].message.content == reference.text
    assert out.choices[0].finish_reason == (
        "length" if reference.finish_reason == "length" else "stop"
    )
    assert out.usage.prompt_tokens == len(fresh_runner().encode(QUESTION))
    assert out.usage.completion_tokens == reference.generation_tokens


def test_streamed_chat_joins_to_the_answer_and_reports_usage(tiny_server, fresh_runner):
    reference = fresh_runner().generate(QUESTION, max_tokens=10)
    chunks = list(
        tiny_server.openai().chat.completions.create(
            model="any",
            messages=QUESTION,
            max_completion_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] is not None
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert len({c.id for c in chunks}) == 1


def test_second_turn_is_served_from_the_cache_and_equals_a_fresh_runner(tiny_server, fresh_runner):
    client = tiny_server.openai()
    messages = [{"role": "system", "content": "You are terse."}, *QUESTION]
    first = client.chat.completions.create(model="m", messages=messages, max_tokens=8)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And then?"},
    ]
    second = client.chat.completions.create(model="m", messages=messages, max_tokens=8)
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens // 2
    assert second.choices[0].message.content == fresh_runner().generate(messages, max_tokens=8).text


def test_completions_endpoint_takes_text_and_token_prompts(tiny_server, fresh_runner):
    client = tiny_server.openai()
    reference = fresh_runner().generate("The quick brown fox", max_tokens=6)
    out = client.completions.create(model="m", prompt="The quick brown fox", max_tokens=6)
    assert out.choices[0].text == reference.text
    ids = fresh_runner().encode("The quick brown fox")
    by_ids = client.completions.create(model="m", prompt=ids, max_tokens=6)
    assert by_ids.choices[0].text == reference.text


def test_stop_string_cuts_the_answer_like_the_runner(tiny_server, fresh_runner):
    free = fresh_runner().generate(QUESTION, max_tokens=12).text
    stop = free[3:6]
    assert stop.strip(), "the reference answer is too short to pick a stop string from"
    out = tiny_server.openai().chat.completions.create(
        model="m", messages=QUESTION, max_tokens=12, stop=[stop]
    )
    assert out.choices[0].message.content == free[: free.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats_and_equals_the_runner(tiny_server, fresh_runner):
    settings = {"temperature": 1.0, "seed": 7, "max_tokens": 12}
    client = tiny_server.openai()
    answers = [
        client.chat.completions.create(model="m", messages=QUESTION, **settings)
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert answers[0] == answers[1] == fresh_runner().generate(QUESTION, **settings).text


def test_logprobs_are_the_models_own(tiny_server, fresh_runner):
    runner = fresh_runner()
    tokens = runner.encode(QUESTION)
    logits = runner.loaded.model(mx.array([tokens]))[0, -1].astype(mx.float32)  # no cache
    reference = (logits - mx.logsumexp(logits)).tolist()
    best = sorted(range(len(reference)), key=lambda i: -reference[i])[:3]
    out = tiny_server.openai().chat.completions.create(
        model="m", messages=QUESTION, max_tokens=3, logprobs=True, top_logprobs=3
    )
    first = out.choices[0].logprobs.content[0]
    assert first.logprob == pytest.approx(reference[best[0]], abs=LOGPROB_ABS)
    assert [t.logprob for t in first.top_logprobs] == pytest.approx(
        [reference[i] for i in best], abs=LOGPROB_ABS
    )
    decode = runner.tokenizer.decode
    assert [t.token for t in first.top_logprobs] == [decode([i]) for i in best]
    assert "".join(t.token for t in out.choices[0].logprobs.content) == (
        out.choices[0].message.content
    )


@pytest.fixture(scope="module")
def scripted_server(scripted_dir):
    from mlxkv import Runner

    with serve(Runner.load(scripted_dir)) as served:
        yield served


def test_tool_call_comes_back_as_tool_calls(scripted_server):
    out = scripted_server.openai().chat.completions.create(
        model="m", messages=QUESTION, tools=TOOLS, max_tokens=10
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let"
    (call,) = choice.message.tool_calls
    expected = json.loads(TOOL_CALL)
    assert call.function.name == expected["name"]
    assert json.loads(call.function.arguments) == expected["arguments"]


def test_streamed_tool_call_and_text_equal_the_plain_answer(scripted_server):
    chunks = list(
        scripted_server.openai().chat.completions.create(
            model="m", messages=QUESTION, tools=TOOLS, max_tokens=10, stream=True
        )
    )
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(d.content or "" for d in deltas) == "Let"
    calls = [call for d in deltas for call in d.tool_calls or []]
    assert [(c.index, c.function.name) for c in calls] == [(0, "get_weather")]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_without_tools_the_call_is_plain_text(scripted_server):
    out = scripted_server.openai().chat.completions.create(
        model="m", messages=QUESTION, max_tokens=10
    )
    assert out.choices[0].message.content == "Let<tool_call>" + TOOL_CALL + "</tool_call>"
    assert out.choices[0].message.tool_calls is None


def test_tool_results_reach_the_template(scripted_server):
    """The answer to a tool result is generated from the conversation the runner renders for
    the same messages: the server's prompt has exactly that many tokens."""
    client = scripted_server.openai()
    first = client.chat.completions.create(model="m", messages=QUESTION, tools=TOOLS, max_tokens=10)
    call = first.choices[0].message.tool_calls[0]
    history = [
        *QUESTION,
        {
            "role": "assistant",
            "content": "Let",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    second = client.chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=10)
    rendered = [
        *QUESTION,
        {
            **history[1],
            "tool_calls": [
                {
                    **history[1]["tool_calls"][0],
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        history[2],
    ]
    expected_tokens = scripted_server.runner.encode(rendered, tools=TOOLS)
    assert "sunny, 21 C" in scripted_server.runner.tokenizer.decode(expected_tokens)
    assert second.usage.prompt_tokens == len(expected_tokens)
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def test_cache_salt_keeps_clients_apart(tiny_server):
    client = tiny_server.openai()
    ask = [{"role": "user", "content": "A secret only this client has seen: 4 7 1 9."}]
    usage = []
    for salt in ("alice", "alice", "mallory"):
        reply = client.chat.completions.create(
            model="m", messages=ask, max_tokens=2, extra_body={"cache_salt": salt}
        )
        usage.append(reply.usage.prompt_tokens_details.cached_tokens)
    assert usage[1] > 0 and usage[2] == 0
    # the page's report lists no entry made with a salt (its size would tell)
    _, report = tiny_server.request("GET", "/v1/mlxkv/cache")
    listed = {e["num_tokens"] for e in report["entries"]}
    salted = {e.num_tokens for e in tiny_server.runner.cache_info().entries if e.isolated}
    assert salted and not listed & salted
