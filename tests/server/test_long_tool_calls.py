"""A tool call long in the writing (an agent's file write: its text is held until the call is
whole) sends events its client's idle watchdog counts (`early_events`): Anthropic an empty
delta in the open block, or in an empty text block opened before the call; Responses
`response.in_progress` again; chat completions a chunk of empty content. Here every held
token is late (`EARLY_EVENT_AFTER_S` 0), and the reply each SDK builds is the one an unmarked
request gets. Chat and text completions also send empty chunks before a late first token."""

from __future__ import annotations

import json
import threading

import pytest

from mlxkv import Runner
from mlxkv.server import early_events, state
from mlxkv.testing.factory import build_scripted_model
from tests.server.conftest import WEATHER, held_worker, serve

# Text, then two calls of two tokens each (pieces never repeat: one token ends the first call
# and opens the second).
SCRIPT = (
    "Let",
    "<tool_call>",
    '{"name":"get_weather",',
    '"arguments":{"city":"Paris"}}',
    "</tool_call><tool_call>",
    '{"name":"get_weather","arguments":',
    '{"city":"Rome"}}',
    "</tool_call>",
)
ASK = [{"role": "user", "content": "Weather in Paris and Rome?"}]
ANTHROPIC_TOOLS = [
    {"name": "get_weather", "description": "w", "input_schema": WEATHER["function"]["parameters"]}
]
RESPONSES_TOOLS = [{"type": "function", **WEATHER["function"]}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = build_scripted_model(tmp_path_factory.mktemp("calls") / "model", SCRIPT)
    with serve(Runner.load(path), model_name="m") as served:
        yield served


def _calls(blocks) -> list[tuple[str, dict]]:
    return [(b.name, b.input) for b in blocks if b.type == "tool_use"]


def test_anthropic_keeps_a_long_call_alive_with_empty_deltas(served, monkeypatch):
    client = served.anthropic()
    options = {"model": "m", "max_tokens": 20, "tools": ANTHROPIC_TOOLS, "messages": ASK}
    plain = client.messages.create(**options)
    monkeypatch.setattr(early_events, "EARLY_EVENT_AFTER_S", 0.0)
    with client.messages.stream(**options) as stream:
        raw = [e for e in stream if e.type.startswith("content_block_")]
        final = stream.get_final_message()
    steps = [
        (e.type, e.index, getattr(getattr(e, "content_block", None), "type", None))
        for e in raw
        if e.type != "content_block_delta" or e.delta.type != "text_delta" or not e.delta.text
    ]
    said = next(i for i, e in enumerate(raw) if getattr(e, "delta", None) and e.delta.text == "Let")
    first_call = next(
        i
        for i, e in enumerate(raw)
        if e.type == "content_block_start" and e.content_block.type == "tool_use"
    )
    between = raw[said + 1 : first_call]
    assert any(e.type == "content_block_delta" and e.index == 0 for e in between), steps
    # after the first call's block, an empty text block kept alive until the second call
    assert ("content_block_start", 2, "text") in steps and ("content_block_delta", 2, None) in steps
    assert [b.type for b in final.content] == ["text", "tool_use", "text", "tool_use"]
    assert final.content[0].text == "Let" and final.content[2].text == ""
    assert _calls(final.content) == _calls(plain.content)
    assert final.stop_reason == plain.stop_reason == "tool_use"


def test_responses_keeps_a_long_call_alive_with_in_progress(served, monkeypatch):
    client = served.openai()
    options = {"model": "m", "input": "Weather in Paris and Rome?", "tools": RESPONSES_TOOLS}
    plain = client.responses.create(**options)
    monkeypatch.setattr(early_events, "EARLY_EVENT_AFTER_S", 0.0)
    with client.responses.stream(**options) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    text_at = kinds.index("response.output_text.delta")
    first_call_at = kinds.index("response.function_call_arguments.delta")
    second_call_at = len(kinds) - 1 - kinds[::-1].index("response.function_call_arguments.delta")
    assert "response.in_progress" in kinds[text_at:first_call_at], kinds
    assert "response.in_progress" in kinds[first_call_at + 1 : second_call_at], kinds
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(events)))
    assert kinds[-1] == "response.completed"

    def calls(output) -> list[tuple[str, dict]]:
        return [(i.name, json.loads(i.arguments)) for i in output if i.type == "function_call"]

    assert [i.type for i in final.output] == [i.type for i in plain.output]
    assert final.output_text == plain.output_text == "Let"
    assert calls(final.output) == calls(plain.output)


def test_chat_completions_keep_a_long_call_alive_with_empty_content(served, monkeypatch):
    """langchain-openai's `stream_chunk_timeout` (120 s) counts only the chunks the `openai`
    SDK yields, not SSE comments."""
    client = served.openai()
    options = {"model": "m", "messages": ASK, "tools": [WEATHER], "max_tokens": 20}
    plain = client.chat.completions.create(**options)
    monkeypatch.setattr(early_events, "EARLY_EVENT_AFTER_S", 0.0)
    chunks = [c.choices[0] for c in client.chat.completions.create(**options, stream=True)]
    said = next(i for i, c in enumerate(chunks) if c.delta.content == "Let")
    first_call = next(i for i, c in enumerate(chunks) if c.delta.tool_calls)
    assert any(c.delta.content == "" for c in chunks[said + 1 : first_call]), chunks
    calls = [call for c in chunks for call in c.delta.tool_calls or []]
    sent = [(c.function.name, json.loads(c.function.arguments)) for c in calls]
    want = plain.choices[0].message
    assert sent == [(c.function.name, json.loads(c.function.arguments)) for c in want.tool_calls]
    assert "".join(c.delta.content or "" for c in chunks) == want.content == "Let"
    assert chunks[-1].finish_reason == plain.choices[0].finish_reason == "tool_calls"


def _chunks_while_held(served, open_stream, count: int) -> tuple[list, bool]:
    """The chunks of `open_stream()` (read on a thread), and whether `count` of them came
    while the worker was held (as a long prefill holds it); it is released then."""
    chunks: list = []
    arrived = threading.Event()

    def read() -> None:
        for each in open_stream():
            chunks.append(each)
            if len(chunks) == count:
                arrived.set()

    reader = threading.Thread(target=read)
    with held_worker(served):
        reader.start()
        seen = arrived.wait(timeout=10)  # 200 keep-alive intervals
    reader.join(timeout=60)
    assert not reader.is_alive()
    return chunks, seen


@pytest.fixture
def early(monkeypatch):
    """Keep-alives every 50 ms, the early events after 100 ms."""
    monkeypatch.setattr(state, "KEEPALIVE_INTERVAL_S", 0.05)
    monkeypatch.setattr(early_events, "EARLY_EVENT_AFTER_S", 0.1)


def test_a_late_first_token_sends_empty_chat_chunks(served, early):
    client = served.openai()
    options = {"model": "m", "messages": ASK, "max_tokens": 1}
    plain = client.chat.completions.create(**options).choices[0].message.content

    chunks, seen = _chunks_while_held(
        served, lambda: client.chat.completions.create(**options, stream=True), 3
    )
    assert seen, chunks
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant" and deltas[1].content == deltas[2].content == ""
    assert "".join(d.content or "" for d in deltas) == plain


def test_a_late_first_token_sends_empty_text_chunks(served, early):
    client = served.openai()
    options = {"model": "m", "prompt": "Weather?", "max_tokens": 2}
    plain = client.completions.create(**options).choices[0].text

    chunks, seen = _chunks_while_held(
        served, lambda: client.completions.create(**options, stream=True), 2
    )
    assert seen, chunks
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts[:2] == ["", ""] and "".join(texts) == plain
