"""A stream whose first token is later than `early_events.EARLY_EVENT_AFTER_S` (the worker
held, as a long prefill holds it) opens content block 0 early and keeps it alive with empty
deltas: the SDKs drop `ping`, and Claude Code's idle watchdog counts only the events its SDK
yields. Read through
the real `anthropic` SDK: the final Message holds what a short request's holds, besides the early
block, left empty, where the reply starts with another kind; a short request's events are
unchanged. Scripted models (`build_template_model`) answer as their script says."""

from __future__ import annotations

import contextlib

import anthropic
import pytest

from mlxkv import Runner
from mlxkv.models.loading import load_model
from mlxkv.runner.scheduling.dispatch import Dispatcher
from mlxkv.server import early_events, state
from mlxkv.testing.factory import TOOLS_CHAT_TEMPLATE
from tests.server.conftest import (
    THINKING_TEMPLATE,
    TOOL_CALL,
    build_template_model,
    held_worker,
    serve,
)

ASK = [{"role": "user", "content": "Capital of France?"}]
TOOLS = [{"name": "get_weather", "input_schema": {"type": "object"}}]
CALL = ("<tool_call>", TOOL_CALL, "</tool_call>")
SCRIPTS = {  # (script, template)
    "text_then_call": (("Let", *CALL), TOOLS_CHAT_TEMPLATE),
    "call": (CALL, TOOLS_CHAT_TEMPLATE),
    "thought": (("<think>", "Hmm.", "</think>", "Paris"), THINKING_TEMPLATE),
    # thinking tags in the vocabulary, an answer without a thought (cut by max_tokens: 1)
    "no_thought": (("Paris", "<think>", "</think>"), THINKING_TEMPLATE),
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Each script's model behind a server, by the script's name."""
    with contextlib.ExitStack() as stack:
        served = {}
        for name, (script, template) in SCRIPTS.items():
            path = build_template_model(tmp_path_factory.mktemp(name), script, template)
            runner = Runner(load_model(path), max_context=512)
            served[name] = stack.enter_context(serve(runner, model_name="m"))
        yield served


def _early_block(monkeypatch) -> None:
    """Keep-alives every 50 ms, the early block after 100 ms."""
    monkeypatch.setattr(state, "KEEPALIVE_INTERVAL_S", 0.05)
    monkeypatch.setattr(early_events, "EARLY_EVENT_AFTER_S", 0.1)


@pytest.fixture
def early_block(monkeypatch):
    _early_block(monkeypatch)


def _short(served, **options):
    """The events and final message of a stream whose first token comes at once."""
    with served.anthropic().messages.stream(model="m", messages=ASK, **options) as stream:
        return list(stream), stream.get_final_message()


def _long(served, **options):
    """As `_short`, the request held in the queue until the SDK has yielded two deltas."""
    events = []
    client = served.anthropic()
    with (
        held_worker(served) as release,
        client.messages.stream(model="m", messages=ASK, **options) as stream,
    ):
        for event in stream:
            events.append(event)
            if sum(e.type == "content_block_delta" for e in events) == 2:
                release.set()  # not before: a lost early block shows as a 60 s wait
        final = stream.get_final_message()
    return events, final


EMPTY_TEXT = {"type": "text", "text": ""}
EMPTY_THOUGHT = {"type": "thinking", "thinking": "", "signature": ""}
THINKING = {"type": "enabled", "budget_tokens": 1024}


def _kept(message) -> dict:
    """What a client keeps of a Message, less what the cache changes (the prompt's split
    into cached and computed tokens) and the id."""
    usage = message.usage
    return {
        "content": [
            block.model_dump(exclude_none=True, exclude={"id"}) for block in message.content
        ],
        "stop": (message.stop_reason, message.stop_sequence),
        "tokens": (
            usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens,
            usage.output_tokens,
        ),
    }


# (model, request options, early block's kind, its content when the reply starts elsewhere)
CASES = {
    "text": ("text_then_call", {}, "text", None),
    "text_then_tool_use": ("text_then_call", {"tools": TOOLS}, "text", None),
    "tool_use": ("call", {"tools": TOOLS}, "text", EMPTY_TEXT),
    "thinking": ("thought", {"thinking": THINKING}, "thinking", None),
    "thinking_disabled": ("thought", {"thinking": {"type": "disabled"}}, "text", None),
    "no_thought": ("no_thought", {"max_tokens": 1}, "thinking", EMPTY_THOUGHT),
    "no_tokens": ("text_then_call", {"max_tokens": 0}, "text", EMPTY_TEXT),
}
# The events on the wire; the SDK's MessageStream adds its own (`text`, `input_json`, ...).
WIRE = {"message_start", "content_block_start", "content_block_delta", "content_block_stop"}
WIRE |= {"message_delta", "message_stop"}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_a_long_prefill_opens_block_0_early_and_ends_as_a_short_one(case, servers, monkeypatch):
    model, options, early_kind, empty = CASES[case]
    options = {"max_tokens": 64, **options}
    short_events, short = _short(servers[model], **options)  # under the default threshold
    _early_block(monkeypatch)
    long_events, long = _long(servers[model], **options)
    long_events = [e for e in long_events if e.type in WIRE]
    assert [e.type for e in long_events[:4]] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
    ]
    assert long_events[1].index == 0 and long_events[1].content_block.type == early_kind
    assert long_events[2].delta.model_dump() == {"type": f"{early_kind}_delta", early_kind: ""}
    expected = _kept(short)
    if empty is not None:
        expected["content"].insert(0, empty)
    assert _kept(long) == expected
    deltas = [e.delta for e in short_events if e.type == "content_block_delta"]
    assert all(value for d in deltas for key, value in d.model_dump().items() if key != "type")


def test_a_short_request_has_no_early_block(servers):
    """The default threshold: a stream answered at once sends what it always sent."""
    events, final = _short(servers["text_then_call"], max_tokens=64, tools=TOOLS)
    assert [(e.type, getattr(e, "index", None)) for e in events] == [
        ("message_start", None),
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("text", None),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("input_json", None),
        ("content_block_stop", 1),
        ("message_delta", None),
        ("message_stop", None),
    ]
    assert [b.type for b in final.content] == ["text", "tool_use"]


def test_a_generation_that_fails_after_the_early_block_ends_with_an_error_event(
    servers, early_block, monkeypatch
):
    def failing(self, request, **options):
        raise RuntimeError("the prefill broke")
        yield  # a generator, as Dispatcher.stream

    served = servers["text_then_call"]
    monkeypatch.setattr(Dispatcher, "stream", failing)
    with pytest.raises(anthropic.APIStatusError, match="generation failed"):
        _long(served, max_tokens=8)
    monkeypatch.undo()  # the server serves on
    assert served.anthropic().messages.create(model="m", messages=ASK, max_tokens=8).content


def test_empty_early_blocks_sent_back_render_as_no_block(servers):
    """Claude Code sends its history back: an empty text or thinking block is accepted and
    the prompt is the one without it."""
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
    empty = [
        {"type": "thinking", "thinking": "", "signature": ""},
        {"type": "text", "text": ""},
    ]
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}

    def history(blocks):
        return [
            *ASK,
            {"role": "assistant", "content": blocks},
            {"role": "user", "content": [result]},
        ]

    client = servers["thought"].anthropic()
    counts = [
        client.messages.count_tokens(model="m", messages=history(blocks), tools=TOOLS)
        for blocks in ([call], [*empty, call])
    ]
    reply = client.messages.create(
        model="m", max_tokens=8, messages=history([*empty, call]), tools=TOOLS
    )
    assert counts[0].input_tokens == counts[1].input_tokens
    assert reply.content


def test_a_client_that_leaves_during_the_early_block_leaves_the_server_consistent(
    servers, early_block
):
    served = servers["text_then_call"]
    client = served.anthropic()
    deltas = 0
    with held_worker(served) as release:
        with client.messages.stream(model="m", messages=ASK, max_tokens=8) as stream:
            for event in stream:
                deltas += event.type == "content_block_delta"
                if deltas == 2:
                    break  # the client leaves while the prefill waits
        release.set()
    events, final = _short(served, max_tokens=64)
    assert [b.model_dump(exclude_none=True) for b in final.content] == [
        {"type": "text", "text": "Let" + "".join(CALL)}
    ]
