"""Recursive JSON schemas that no finite value satisfies.

Owns `check_finite_schema`. llguidance compiles recursion (`$ref` back to an enclosing schema)
as grammar rules, and a tree whose recursion can end (children in an array, an optional or
nullable child) works. A recursion that cannot end (`{"$ref": "#"}`, a child that is
required and must again have a required child) compiles too, but its language is empty: the
reply was an empty string ended by "stop", or JSON that grows until `max_tokens`. Such a
schema is refused before anything runs, naming the `$ref`.

Terms:
  finite  a schema some JSON value of finite depth satisfies. Computed as the least fixed
          point over the schema's local `$ref`s (each starts as not finite, and becomes finite
          once its target is, given the others), so a reference that can only reach itself
          stays not finite. Checks only what decides recursion (`$ref`, `allOf`, `anyOf`,
          `oneOf`, `type`, required `properties`, `minItems` with `items`/`prefixItems`);
          other constraints are llguidance's to check. Remote `$ref`s count as finite.
"""

from __future__ import annotations

from typing import Any

Schema = Any  # a dict, or True/False


def check_finite_schema(schema: Schema) -> None:
    """Raises:
    ValueError: `schema` has no finite value because of a `$ref` that can only lead back to
        itself; the message names it and says how to let the recursion end.
    """
    refs = _local_refs(schema)
    finite = dict.fromkeys(refs, False)
    changed = True
    while changed:  # least fixed point: at most one pass per reference
        changed = False
        for ref in refs:
            if not finite[ref] and _has_value(_resolve(schema, ref), finite):
                finite[ref] = changed = True
    if not _has_value(schema, finite):
        stuck = [ref for ref in refs if not finite[ref]]
        named = f"'$ref': {stuck[0]!r}" if stuck else "the schema"
        raise ValueError(
            f"the JSON schema has no finite value: {named} always needs another value of "
            "itself inside it, so the recursion never ends; let it end (make the recursive "
            'property optional, nullable with anyOf [..., {"type": "null"}], or the items of '
            "an array that may be empty)"
        )


def _has_value(node: Schema, finite: dict[str, bool]) -> bool:
    if node is False:
        return False
    if not isinstance(node, dict):
        return True
    ref = node.get("$ref")
    if isinstance(ref, str) and not finite.get(ref, True):
        return False
    if not all(_has_value(s, finite) for s in _list(node.get("allOf"))):
        return False
    for key in ("anyOf", "oneOf"):
        choices = _list(node.get(key))
        if choices and not any(_has_value(s, finite) for s in choices):
            return False
    types = node.get("type")
    if types is None:
        return _typed_value(node, None, finite)
    types = types if isinstance(types, list) else [types]
    return any(_typed_value(node, kind, finite) for kind in types)


def _typed_value(node: dict[str, Any], kind: str | None, finite: dict[str, bool]) -> bool:
    """Whether a value of JSON type `kind` (None: the type the keywords imply) can satisfy
    `node`'s object or array keywords."""
    if kind == "object" or (kind is None and ("properties" in node or "required" in node)):
        properties = node.get("properties") or {}
        required = [p for p in _list(node.get("required")) if p in properties]
        return all(_has_value(properties[p], finite) for p in required)
    if kind == "array" or (kind is None and ("items" in node or "prefixItems" in node)):
        minimum = node.get("minItems", 0)
        prefix = _list(node.get("prefixItems"))
        if not isinstance(minimum, int) or minimum <= 0:
            return True
        needed = prefix[:minimum]
        if len(needed) < minimum and not _has_value(node.get("items", True), finite):
            return False
        return all(_has_value(s, finite) for s in needed)
    return True


def _local_refs(schema: Schema) -> list[str]:
    """Every local `$ref` ("#..."), in the order first met."""
    found: dict[str, None] = {}
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#") and _resolve(schema, ref) is not None:
                found[ref] = None
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return list(found)


def _resolve(schema: Schema, ref: str) -> Schema | None:
    """The schema a local JSON-pointer reference names, or None."""
    node = schema
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []
