"""A `tool_choice` that requires a call, kept by a grammar: OpenAI's `"required"` and
`{"type": "function", "function": {"name": ...}}`, Responses' `"required"` and
`{"type": "function", "name": ...}`, Anthropic's `{"type": "any"}` and
`{"type": "tool", "name": ...}`.

Owns `forced_call_grammar`: the llguidance grammar (Lark, with the arguments as a JSON schema)
of one call, whose arguments validate against the tool's parameters. The reply is that call,
then EOS. It is written in the model's own tool-call format where that format is the tool's
name and its arguments as one JSON value, so that the schema keeps the arguments exactly
(mlx-lm's parsers, by the model's chat template):
  - `json_tools` (Qwen 2.5/3, Hermes and the models that copy them):
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
  - `mistral`: `[TOOL_CALLS]name[ARGS]{...}` where the template renders `[ARGS]` (Mistral
    Small 3.2, Devstral, Magistral), else `[TOOL_CALLS][{"name": ..., "arguments": {...},
    "id": "<9 letters and digits>"}]` (Mistral 7B v0.3, Nemo: the id as their templates
    render it back, and refuse any other); not with a template with `[CALL_ID]` (mlx-lm's
    parser would read the id as the name), nor for a name mlx-lm cannot read back after
    `[TOOL_CALLS]` (it reads letters, digits, `_` and `-`: a `.` or `:` would be lost);
  - `kimi_k2`: `<|tool_calls_section_begin|><|tool_call_begin|>functions.name:N
    <|tool_call_argument_begin|>{...}<|tool_call_end|><|tool_calls_section_end|>`, N the
    number of calls before it in the conversation (Kimi counts its calls across the whole
    conversation; the id is kept and sent back, `tool_calls`).
Formats that spell arguments as XML parameters, Python calls or key-value text (`qwen3_coder`,
`glm47`, `minimax_m2`, `longcat`, `pythonic`, `function_gemma`, ...) type each value by the
parser's own reading of the schema, which a JSON schema grammar does not match; those, a name
the model's format cannot carry, and models with no format at all (SmolLM2, most small chat
models) write the call as a bare JSON object instead, `{"name": ..., "arguments": {...}}`,
which `tool_calls.BareCallReader` reads back: a client that requires a call (pydantic-ai's
typed output, instructor's TOOLS mode, LangChain's structured output, the Agents SDK) gets one
whose arguments validate, whatever the model. Where a call object wraps the arguments, each
tool's parameters sit in the root's `$defs`, their `$ref`s rebased there, so a nested model's
`#/$defs/...` (pydantic's) still points into them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llguidance import LLMatcher

from mlxkv.decoding.grammar import DATA_KEYWORDS, NAMED_SCHEMAS, bounded_integers
from mlxkv.server.errors import ApiError

_PARSERS = "mlx_lm.tool_parsers."
# At most one space between JSON tokens: a small model cannot pad a call with whitespace.
_WHITESPACE = {"whitespace_pattern": "[ ]?"}
# The names mlx-lm's `mistral` parser reads before `[ARGS]`.
_MISTRAL_NAME = re.compile(r"[\w-]+")


@dataclass(frozen=True)
class ForcedCall:
    """A reply that must be a tool call: of the tool `name`, or of any tool (None)."""

    name: str | None = None


@dataclass(frozen=True)
class ForcedGrammar:
    """The grammar of a forced call, and how the call is written: in the model's own format
    (`own_format`, read back by its parser), else as a bare JSON call object."""

    grammar: str
    own_format: bool


def forced_call_grammar(
    tokenizer: Any, tools: list[dict[str, Any]], forced: ForcedCall, messages: Any = None
) -> ForcedGrammar:
    """The grammar of one call to `forced.name` (or to any of `tools`): in the model's format
    where it can be forced, else a bare JSON call object.

    Args:
        tokenizer: mlx-lm's TokenizerWrapper (its tool-call markers and parser).
        tools: the request's tools as the chat template takes them
            (`{"type": "function", "function": {"name", "parameters"}}`).
        messages: the conversation as the chat template takes it (Kimi numbers the call
            after the calls in it); a text or token prompt has none.

    Raises:
        ApiError: 400 when there is no tool to call.
    """
    functions = [tool["function"] for tool in tools or []]
    if forced.name is not None:
        functions = [f for f in functions if f["name"] == forced.name]
    if not functions:
        raise ApiError(
            400, "tool_choice requires a tool call but no tools were sent", param="tool_choice"
        )
    body = _call_grammar(tokenizer, functions, _calls_in(messages))
    if body is None:
        body = f"start: call\ncall: {_json(_one_call(functions))}\n"
        return ForcedGrammar(LLMatcher.grammar_from_lark(body), own_format=False)
    return ForcedGrammar(LLMatcher.grammar_from_lark(body), own_format=True)


def _calls_in(messages: Any) -> int:
    """How many tool calls the assistant made in `messages` (chat-template dicts)."""
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        return 0
    return sum(len(m.get("tool_calls") or []) for m in messages if isinstance(m, dict))


def _call_grammar(tokenizer: Any, functions: list[dict[str, Any]], calls_before: int) -> str | None:
    """The Lark grammar of one call in the model's format; None where it cannot be forced."""
    if not getattr(tokenizer, "has_tool_calling", False):
        return None
    parser = getattr(tokenizer.tool_parser, "__module__", "") or ""
    start = _marker(tokenizer, tokenizer.tool_call_start)
    end = _marker(tokenizer, tokenizer.tool_call_end) if tokenizer.tool_call_end else ""
    if parser == f"{_PARSERS}json_tools":
        return f'start: {start} "\\n"? call "\\n"? {end}\ncall: {_json(_one_call(functions))}\n'
    if parser == f"{_PARSERS}mistral":
        return _mistral(tokenizer, functions, start)
    if parser == f"{_PARSERS}kimi_k2":
        return _kimi(tokenizer, functions, start, end, calls_before)
    return None


def _mistral(tokenizer: Any, functions: list[dict[str, Any]], start: str) -> str | None:
    """Mistral's two formats, told apart by the template (what the model was trained on)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or "[CALL_ID]" in template:
        return None
    if "[ARGS]" in template:
        if not all(_MISTRAL_NAME.fullmatch(f["name"]) for f in functions):
            return None  # mlx-lm would read back another name
        args = _marker(tokenizer, "[ARGS]")
        calls = " | ".join(f"{json.dumps(f['name'])} {args} {_arguments(f)}" for f in functions)
        return f"start: {start} call\ncall: {calls}\n"
    one = _one_call(functions, _MISTRAL_CALL_ID)
    defs = one.pop("$defs")  # the document's root is the list
    schema = {"type": "array", "items": one, "minItems": 1, "maxItems": 1, "$defs": defs}
    return f'start: {start} " "? call\ncall: {_json(schema)}\n'


def _kimi(tokenizer: Any, functions: list[dict[str, Any]], start: str, end: str, index: int) -> str:
    """Kimi K2's section of one call; its id (`functions.NAME:INDEX`) names the function and
    counts the conversation's calls."""
    begin, argument, close = (
        _marker(tokenizer, f"<|tool_call_{part}|>") for part in ("begin", "argument_begin", "end")
    )
    calls = []
    for function in functions:
        call_id = json.dumps(f"functions.{function['name']}:{index}")
        calls.append(f"{begin} {call_id} {argument} {_arguments(function)} {close}")
    return f"start: {start} call {end}\ncall: {' | '.join(calls)}\n"


def _json(schema: dict[str, Any]) -> str:
    """A JSON value of `schema` in Lark, with at most one space between its tokens and its
    integers bounded (`bounded_integers`)."""
    return f"%json {json.dumps({**bounded_integers(schema), 'x-guidance': _WHITESPACE})}"


def _arguments(function: dict[str, Any]) -> str:
    return _json(_parameters(function))


def _parameters(function: dict[str, Any]) -> Any:
    """The tool's parameters with every object that lists its `properties` and that nothing
    else brings keys into closed to others (`additionalProperties: false`, as llama.cpp's
    grammars and OpenAI's strict mode take it): JSON Schema allows any other key there, and a
    small model adds keys (or nests the call again in a tool without parameters) until
    `max_tokens`, so the call never ends; arguments of the listed keys validate all the same.
    Not where a sibling keyword (`anyOf`, `$ref`, `if`, ...) adds keys to the same object:
    each part, closed, would refuse the others' keys and no call could be written. Runs until
    the `$ref` targets found in such places stop growing (a target may be walked before the
    `$ref` that opens it)."""
    parameters = function.get("parameters") or {"type": "object"}
    opened: set[str] = set()
    for _ in range(json.dumps(parameters).count('"$ref"') + 1):  # a pass opens one or stops
        num_opened = len(opened)
        closed = _closed(parameters, "#", False, opened)
        if len(opened) == num_opened:
            break
    return closed


# Keywords whose schemas apply to the object they sit on.
_IN_PLACE = frozenset(
    {"allOf", "anyOf", "oneOf", "if", "then", "else", "not", "$ref", "$dynamicRef"}
    | {"dependentSchemas", "dependencies"}
)
# Keywords that bring keys into the object they sit on, besides its own `properties`.
_OPENERS = (
    _IN_PLACE - {"not"} | {"additionalProperties", "patternProperties"} | {"unevaluatedProperties"}
)
# Keywords of an object's keys: the branches of its combinators must leave room for them.
_OWN_KEYS = _OPENERS | {"properties", "required", "dependentRequired"}
# Keywords whose one schema may stand alone for the object (one branch of several, a pointer).
_ALTERNATIVES = frozenset({"anyOf", "oneOf", "$ref"})


def _closed(schema: Any, pointer: str, extended: bool, opened: set[str]) -> Any:
    """`schema` (at JSON pointer `pointer`) with its plain objects closed; `extended`: keys of
    this object may come from a sibling schema, so it stays open. Adds to `opened` the
    `$ref` targets that sit in such a place (walked open on the next pass)."""
    if isinstance(schema, list):
        return [_closed(item, f"{pointer}/{i}", extended, opened) for i, item in enumerate(schema)]
    if not isinstance(schema, dict):
        return schema
    schema = _distributed(schema)
    extended = extended or pointer in opened
    closed = {}
    for key, value in schema.items():
        at = f"{pointer}/{_escaped(key)}"
        # A branch is alone only in an anyOf/oneOf/$ref of a parent with no keys of its own.
        in_place = key in _IN_PLACE
        shared = extended or key not in _ALTERNATIVES or bool((_OWN_KEYS - {key}) & schema.keys())
        if key == "$ref" and isinstance(value, str) and shared:
            opened.add(value)
        if key in DATA_KEYWORDS or key == "$ref":
            closed[key] = value
        elif key in NAMED_SCHEMAS and isinstance(value, dict):
            branch = in_place and shared
            closed[key] = {
                name: _closed(sub, f"{at}/{_escaped(name)}", branch, opened)
                for name, sub in value.items()
            }
        else:
            closed[key] = _closed(value, at, in_place and shared, opened)
    if isinstance(schema.get("properties"), dict) and not (extended or _OPENERS & schema.keys()):
        closed["additionalProperties"] = False
    return closed


# Keywords of a plain object: its keys, the ones it requires, and notes.
_PLAIN = frozenset({"type", "properties", "required", "title", "description"})


def _distributed(schema: dict[str, Any]) -> dict[str, Any]:
    """A plain object with an `anyOf`/`oneOf` of plain branches as the same alternatives
    with its keys copied into each branch, which can then be closed: each takes its own keys
    and the parent's, which a small model would otherwise extend until `max_tokens` (the same
    calls validate). Else `schema` as given."""
    combinators = schema.keys() & _ALTERNATIVES
    if len(combinators) != 1 or not schema.keys() - combinators <= _PLAIN:
        return schema
    (combinator,) = combinators
    names = schema.get("properties", {})
    branches = schema[combinator]
    if not isinstance(names, dict) or not isinstance(branches, list) or not names:
        return schema
    if not all(isinstance(b, dict) and b.keys() <= _PLAIN for b in branches):
        return schema
    if any(names.keys() & b.get("properties", {}).keys() for b in branches):
        return schema  # one key typed by both: left as sent
    required = list(schema.get("required", []))
    parent = {k: v for k, v in schema.items() if k not in ("properties", "required", combinator)}
    return {
        **parent,
        combinator: [
            {
                **b,
                "properties": {**names, **b.get("properties", {})},
                "required": required + list(b.get("required", [])),
            }
            for b in branches
        ],
    }


def _escaped(name: str) -> str:
    """`name` as one JSON pointer step."""
    return name.replace("~", "~0").replace("/", "~1")


# The id Mistral 7B v0.3 and Nemo write after a call's arguments (their templates render it so).
_MISTRAL_CALL_ID = {"id": {"type": "string", "pattern": "^[A-Za-z0-9]{9}$"}}


# Where each tool's parameters live in a call's schema: `$defs` of the document's root.
_ARGUMENTS = "mlxkv_arguments_"


def _one_call(
    functions: list[dict[str, Any]], extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A call to any of `functions` as a schema document: its root's `$defs` holds each
    tool's parameters, whose own `$ref`s (`#/$defs/...`, as pydantic writes nested models)
    point at their root, so each is moved there with its pointers rebased (two tools'
    `$defs` of one name stay apart)."""
    defs, calls = {}, []
    for index, function in enumerate(functions):
        key = f"{_ARGUMENTS}{index}"
        defs[key] = _rebased(_parameters(function), f"#/$defs/{key}")
        calls.append(_call_schema(function["name"], {"$ref": f"#/$defs/{key}"}, extra))
    return {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "$defs": defs}


def _rebased(schema: Any, root: str) -> Any:
    """`schema` with every local `$ref` ("#...", relative to its root) under `root`."""
    if isinstance(schema, list):
        return [_rebased(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rebased = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            rebased[key] = root + value[1:]
        elif key in NAMED_SCHEMAS and isinstance(value, dict):
            rebased[key] = {name: _rebased(sub, root) for name, sub in value.items()}
        elif key in DATA_KEYWORDS:
            rebased[key] = value
        else:
            rebased[key] = _rebased(value, root)
    return rebased


def _call_schema(
    name: str, arguments: dict[str, Any], extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A call object: its name, its arguments, then any `extra` properties, all required."""
    properties = {"name": {"const": name}, "arguments": arguments, **(extra or {})}
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
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
