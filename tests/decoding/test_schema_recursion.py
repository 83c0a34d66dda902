"""Recursive JSON schemas: those whose recursion can end pass, those that cannot are refused
naming the `$ref` (llguidance compiles both; the second matches nothing)."""

from __future__ import annotations

import re

import pytest

from mlxkv.decoding.schema_recursion import check_finite_schema

NODE = {
    "type": "object",
    "properties": {"value": {"type": "integer"}, "next": {"$ref": "#"}},
    "required": ["value"],
}
ENDS = {
    "optional-child": NODE,
    "nullable-child": {
        "$ref": "#/$defs/n",
        "$defs": {
            "n": {
                "type": "object",
                "properties": {"next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}},
                "required": ["next"],
            }
        },
    },
    "children-array": {
        "type": "object",
        "properties": {"children": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["children"],
    },
    "not-recursive": {"$ref": "#/$defs/s", "$defs": {"s": {"type": "string"}}},
}
NEVER_ENDS = {
    "root-ref": ({"$ref": "#"}, "#"),
    "required-child": ({**NODE, "required": ["value", "next"]}, "#"),
    "defs-loop": ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}, "#/$defs/a"),
    "non-empty-array": (
        {"type": "array", "minItems": 1, "items": {"$ref": "#"}},
        "#",
    ),
    "every-branch-recurses": (
        {"$ref": "#/$defs/x", "$defs": {"x": {"anyOf": [{"$ref": "#/$defs/x"}, False]}}},
        "#/$defs/x",
    ),
}


@pytest.mark.parametrize("schema", ENDS.values(), ids=ENDS.keys())
def test_a_recursion_that_can_end_passes(schema):
    check_finite_schema(schema)


@pytest.mark.parametrize("schema, ref", NEVER_ENDS.values(), ids=NEVER_ENDS.keys())
def test_a_recursion_that_cannot_end_is_refused_naming_the_ref(schema, ref):
    with pytest.raises(ValueError, match=re.escape(f"no finite value: '$ref': '{ref}'")):
        check_finite_schema(schema)
