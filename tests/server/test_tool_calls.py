"""ToolCallSplitter against a one-shot reference, whatever the chunking of the stream."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from mlx_lm.tool_parsers import json_tools, kimi_k2, mistral

from mlxkv.server.anthropic_api.tool_ids import client_id, model_id
from mlxkv.server.reply.tool_calls import ToolCall, ToolCallSplitter

CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TEXT = f"Let me check.<tool_call>{CALL}</tool_call> Done <tool <tool_call>not json</tool_call>"


def _splitter() -> ToolCallSplitter:
    return ToolCallSplitter("<tool_call>", "</tool_call>", json_tools.parse_tool_call, None)


def _run(chunks: list[str]) -> list:
    splitter = _splitter()
    pieces = [p for chunk in chunks for p in splitter.push(chunk)] + splitter.finish()
    merged: list = []
    for piece in pieces:  # adjacent text joined: chunking may split text anywhere
        if isinstance(piece, str) and merged and isinstance(merged[-1], str):
            merged[-1] += piece
        else:
            merged.append(piece)
    return [(p.name, p.arguments) if isinstance(p, ToolCall) else p for p in merged]


EXPECTED = [
    "Let me check.",
    ("get_weather", json.loads(CALL)["arguments"]),
    " Done <tool <tool_call>not json</tool_call>",  # a call that does not parse stays text
]


@given(st.lists(st.integers(0, len(TEXT)), max_size=12))
def test_any_chunking_gives_the_same_text_and_calls(cuts):
    bounds = [0, *sorted(cuts), len(TEXT)]
    chunks = [TEXT[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert _run(chunks) == EXPECTED


def test_no_partial_marker_is_ever_released_as_text():
    splitter = _splitter()
    released = [p for ch in "ab<tool_c" for p in splitter.push(ch)]
    assert "".join(released) == "ab"
    assert splitter.finish() == ["<tool_c"]


def test_an_unterminated_call_is_parsed_at_the_end_or_returned_as_text():
    assert _run([f"<tool_call>{CALL}"]) == [EXPECTED[1]]
    assert _run(['<tool_call>{"name": "f", "argu']) == ['<tool_call>{"name": "f", "argu']


def _ids(parser, body: str) -> list[str]:
    splitter = ToolCallSplitter(
        parser.tool_call_start, parser.tool_call_end, parser.parse_tool_call, None
    )
    pieces = splitter.push(parser.tool_call_start + body + parser.tool_call_end) + splitter.finish()
    return [piece.id for piece in pieces if isinstance(piece, ToolCall)]


def test_a_call_keeps_the_id_the_model_wrote():
    """The client sends the id back and the template renders it where the model wrote it."""
    kimi = "<|tool_call_begin|>functions.f:3<|tool_call_argument_begin|>{}<|tool_call_end|>"
    assert _ids(kimi_k2, kimi) == ["functions.f:3"]
    assert _ids(mistral, '[{"name": "f", "arguments": {}, "id": "abcDEF123"}]') == ["abcDEF123"]


def test_ids_made_for_mistral_are_what_its_templates_take():
    """Mistral's templates refuse any id but 9 letters and digits: one the model did not
    write, or wrote in another shape, is made in that shape; other formats get `call_...`."""
    made = _ids(mistral, "f[ARGS]{}") + _ids(mistral, '[{"name": "f", "arguments": {}, "id": "x"}]')
    assert all(re.fullmatch("[A-Za-z0-9]{9}", made_id) for made_id in made) and len(made) == 2
    (other,) = _ids(json_tools, CALL)
    assert other.startswith("call_")


@pytest.mark.parametrize(
    "call",
    [
        '{"name": "f", "arguments": {}, "id": "\\ud800"}',
        '{"name": "f", "arguments": {"city": "\\udc00"}}',
        '{"name": "\\ud800", "arguments": {}}',
    ],
    ids=["id", "arguments", "name"],
)
def test_a_call_with_a_lone_surrogate_goes_back_as_the_text_written(call):
    """A JSON escape that decodes to half a UTF-16 pair: no response could carry it (it was
    a 500, or a stream cut short), so the call stays the text the model wrote."""
    assert _run([f"<tool_call>{call}</tool_call>"]) == [f"<tool_call>{call}</tool_call>"]


@given(st.text(min_size=1))
@example("toolu_mlxkv_ZnVuY3Rpb25zLmY6MA")  # written by a model in our encoded form
def test_anthropic_ids_are_valid_and_read_back_as_the_model_wrote_them(written):
    sent = client_id(written)
    assert re.fullmatch("[a-zA-Z0-9_-]+", sent) and model_id(sent) == written


def test_ids_anthropic_clients_made_pass_through():
    for sent in ("toolu_01A09q90qw90lq917835lq9", "toolu_mlxkv_", "toolu_mlxkv_!!", "abc"):
        assert model_id(sent) == sent
