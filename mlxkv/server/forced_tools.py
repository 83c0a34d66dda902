"""A `tool_choice` that requires a call, kept by a grammar: OpenAI's `"required"` and
`{"type": "function", "function": {"name": ...}}`, Responses' `"required"` and
`{"type": "function", "name": ...}`, Anthropic's `{"type": "any"}` and
`{"type": "tool", "name": ...}`.

Owns `forced_call_grammar`: the llguidance grammar (Lark, with the call as a JSON schema) of
one call in the model's own tool-call format, its start and end markers around
`{"name": ..., "arguments": {...}}` whose arguments validate against the tool's parameters.
The reply is that call, then EOS. The format must be known to be JSON between markers (mlx-lm's
`json_tools` parser: Qwen 2.5/3, Hermes and the models that copy them); for any other model a
forced call is refused with a 400 rather than answered with text the client did not ask for:
a client that requires a call breaks on a reply without one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from llguidance import LLMatcher

from mlxkv.server.errors import ApiError

# mlx-lm's parsers whose calls are `{"name": ..., "arguments": {...}}` between the markers.
_JSON_CALL_PARSERS = ("mlx_lm.tool_parsers.json_tools",)
# At most one space between JSON tokens: a small model cannot pad a call with whitespace.
_WHITESPACE = {"whitespace_pattern": "[ ]?"}


@dataclass(frozen=True)
class ForcedCall:
    """A reply that must be a tool call: of the tool `name`, or of any tool (None)."""

    name: str | None = None


def forced_call_grammar(tokenizer: Any, tools: list[dict[str, Any]], forced: ForcedCall) -> str:
    """The grammar of one call to `forced.name` (or to any of `tools`) in the model's format.

    Args:
        tokenizer: mlx-lm's TokenizerWrapper (its tool-call markers and parser).
        tools: the request's tools as the chat template takes them
            (`{"type": "function", "function": {"name", "parameters"}}`).

    Raises:
        ApiError: 400 when there is no tool to call, or the model's tool-call format cannot
            be forced (none known, or not JSON between markers).
    """
    functions = [tool["function"] for tool in tools or []]
    if forced.name is not None:
        functions = [f for f in functions if f["name"] == forced.name]
    if not functions:
        raise ApiError(
            400, "tool_choice requires a tool call but no tools were sent", param="tool_choice"
        )
    parser = getattr(getattr(tokenizer, "tool_parser", None), "__module__", None)
    if not getattr(tokenizer, "has_tool_calling", False) or parser not in _JSON_CALL_PARSERS:
        known = (
            f"its tool-call format ({parser}) cannot be forced yet"
            if getattr(tokenizer, "has_tool_calling", False)
            else "it has no tool-call format mlx-lm knows"
        )
        raise ApiError(
            400,
            "tool_choice requires a tool call, which this model cannot be made to write: "
            f"{known}; send tool_choice auto (the model may then call a tool or answer)",
            param="tool_choice",
        )
    calls = [_call_schema(f) for f in functions]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    start = _marker(tokenizer, tokenizer.tool_call_start)
    end = _marker(tokenizer, tokenizer.tool_call_end) if tokenizer.tool_call_end else ""
    schema = {**schema, "x-guidance": _WHITESPACE}
    lark = f'start: {start} "\\n"? call "\\n"? {end}\ncall: %json {json.dumps(schema)}\n'
    return LLMatcher.grammar_from_lark(lark)


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters") or {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _marker(tokenizer: Any, text: str) -> str:
    """The marker in Lark: its token (`<[id]>`) when it is one added token (llguidance reads
    added tokens as special, never as their text), else the text."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    if len(ids) == 1 and ids[0] in added:
        return f"<[{ids[0]}]>"
    return json.dumps(text)
