"""The parameters a forced call is kept to: plain objects are closed to unlisted keys (a small
model adds keys until `max_tokens`), but an object whose keys also come from a sibling
keyword (`anyOf`, `oneOf`, `$ref`, `patternProperties`, `if`/`then`, ...) stays open, and so do
the branches that add them: closed, each part would refuse the others' keys and no call could
be written. A plain object's plain `anyOf`/`oneOf` branches take its keys and are closed.
Checked by the grammar itself (llguidance, through `json_schema_grammar`)."""

from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher

from mlxkv.decoding.grammar import _llguidance_tokenizer, json_schema_grammar
from mlxkv.server.reply.forced_tools import _parameters

INT = {"type": "integer"}
KIND = {"kind": {"type": "string"}}
X_OR_Y = [
    {"properties": {"x": INT}, "required": ["x"]},
    {"properties": {"y": INT}, "required": ["y"]},
]
TAGGED = [
    {"properties": {"kind": {"const": "a"}, "x": INT}, "required": ["kind", "x"]},
    {"properties": {"kind": {"const": "b"}, "y": INT}, "required": ["kind", "y"]},
]
BASE = {"type": "object", "properties": {"x": INT}, "required": ["x"]}
# Each schema with a call that validates against it, whose keys come from two places.
EXTENDED = {
    "anyOf-beside-properties": (
        {"type": "object", "properties": KIND, "required": ["kind"], "anyOf": X_OR_Y},
        {"kind": "a", "x": 1},
    ),
    "oneOf-beside-properties": (
        {"type": "object", "properties": {"note": {"type": "string"}}, "oneOf": TAGGED},
        {"note": "n", "kind": "a", "x": 1},
    ),
    "ref-beside-properties": (
        {"type": "object", "properties": KIND, "$ref": "#/$defs/Base", "$defs": {"Base": BASE}},
        {"kind": "a", "x": 1},
    ),
    "ref-target-walked-first": (
        {"$defs": {"Base": BASE}, "type": "object", "properties": KIND, "$ref": "#/$defs/Base"},
        {"kind": "a", "x": 1},
    ),
    "patternProperties-beside-anyOf": (
        {"type": "object", "patternProperties": {"^x_": INT}, "anyOf": [{"properties": KIND}]},
        {"kind": "a", "x_1": 2},
    ),
    "nested-anyOf-beside-properties": (
        {"type": "object", "properties": {"shape": {"properties": KIND, "anyOf": X_OR_Y}}},
        {"shape": {"kind": "a", "y": 2}},
    ),
}
PLACE = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
# Each plain schema with a call it refuses once closed, and one it still accepts.
PLAIN = {
    "no-parameters": ({"type": "object", "properties": {}}, {"x": 1}, {}),
    "listed-keys": (PLACE, {"city": "Rome", "x": 1}, {"city": "Rome"}),
    "union-branches": ({"anyOf": [PLACE, BASE]}, {"x": 1, "y": 2}, {"x": 1}),
    "bare-ref-target": (
        {"type": "object", "properties": {"at": {"$ref": "#/$defs/P"}}, "$defs": {"P": PLACE}},
        {"at": {"city": "Rome", "x": 1}},
        {"at": {"city": "Rome"}},
    ),
    "anyOf-branches-take-the-parent-keys": (
        {"type": "object", "properties": KIND, "required": ["kind"], "anyOf": X_OR_Y},
        {"kind": "a", "x": 1, "z": 2},
        {"kind": "a", "x": 1},
    ),
    "object-inside-an-open-one": (
        {"type": "object", "properties": {"at": PLACE}, "anyOf": X_OR_Y, "minProperties": 1},
        {"at": {"city": "Rome", "x": 1}, "x": 1},
        {"at": {"city": "Rome"}, "x": 1},
    ),
}


@pytest.fixture(scope="module")
def accepts(loaded_tiny):
    """Whether the grammar of `schema` accepts `value` written as JSON, token by token."""
    tokenizer = loaded_tiny("llama").tokenizer
    llg_tokenizer = _llguidance_tokenizer(tokenizer)

    def _accepts(schema: dict, value: dict) -> bool:
        matcher = LLMatcher(llg_tokenizer, json_schema_grammar(schema))
        assert not matcher.is_error(), matcher.get_error()
        text = json.dumps(value, separators=(", ", ": "))
        ids = tokenizer.encode(text, add_special_tokens=False)
        return all(matcher.consume_token(i) for i in ids) and matcher.is_accepting()

    return _accepts


@pytest.mark.parametrize("case", list(EXTENDED))
def test_keys_from_a_sibling_keyword_can_be_written(accepts, case):
    schema, value = EXTENDED[case]
    assert accepts(schema, value)  # the schema as sent takes it
    assert accepts(_parameters({"parameters": schema}), value), _parameters({"parameters": schema})


@pytest.mark.parametrize("case", list(PLAIN))
def test_plain_objects_still_refuse_unlisted_keys(accepts, case):
    schema, refused, valid = PLAIN[case]
    assert accepts(schema, refused)  # JSON Schema allows the key
    closed = _parameters({"parameters": schema})
    assert not accepts(closed, refused) and accepts(closed, valid), closed


@pytest.mark.parametrize(
    "schema",
    [
        {"properties": KIND, "if": {"properties": {"kind": {"const": "a"}}}, "then": X_OR_Y[0]},
        {"properties": KIND, "dependentSchemas": {"kind": X_OR_Y[0]}},
        {"properties": KIND, "dependencies": {"kind": X_OR_Y[0]}},
        {"properties": KIND, "unevaluatedProperties": INT},
    ],
    ids=["if-then", "dependentSchemas", "dependencies", "unevaluatedProperties"],
)
def test_keys_brought_by_keywords_the_grammar_cannot_check_are_left_open(schema):
    """llguidance does not compile these; left as sent, neither part refuses the other's key."""
    assert _parameters({"parameters": schema}) == schema
