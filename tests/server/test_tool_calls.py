"""ToolCallSplitter against a one-shot reference, whatever the chunking of the stream."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.tool_parsers import json_tools

from mlxkv.server.tool_calls import ToolCall, ToolCallSplitter

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
