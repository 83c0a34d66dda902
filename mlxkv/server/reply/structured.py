"""Structured outputs as each API asks for them, turned into a grammar the reply keeps to
token by token (`mlxkv.decoding.grammar`): OpenAI's `response_format` (chat) and
`text.format` (Responses), Anthropic's `output_config.format` (or the beta's `output_format`),
Ollama's `format`. JSON that
parses and validates comes back, unless `max_tokens` cuts it (finish reason "length").
"""

from __future__ import annotations

from typing import Any

from mlxkv.decoding.grammar import JSON_OBJECT_SCHEMA, json_schema_grammar
from mlxkv.errors import GrammarError
from mlxkv.server.errors import ApiError


def openai_grammar(response_format: dict[str, Any] | None, param: str) -> str | None:
    """Chat's `{"type": "json_schema", "json_schema": {"schema": ...}}`, Responses'
    `{"type": "json_schema", "schema": ...}`, or `{"type": "json_object"}`; `text`: none."""
    if not response_format or response_format.get("type") == "text":
        return None
    kind = response_format.get("type")
    if kind == "json_object":
        return json_schema_grammar(JSON_OBJECT_SCHEMA)
    if kind == "json_schema":
        nested = response_format.get("json_schema")  # chat's form; Responses' is flat
        schema = nested.get("schema") if isinstance(nested, dict) else response_format.get("schema")
        return _grammar(_schema(schema, param), param)
    raise ApiError(
        400, f"{param}.type {kind!r} is not one of text, json_object, json_schema", param=param
    )


def anthropic_grammar(
    output_config: dict[str, Any] | None, output_format: dict[str, Any] | None = None
) -> str | None:
    """`output_config.format`: `{"type": "json_schema", "schema": {...}}`; else the same
    object as the structured-outputs beta spelled it, a top-level `output_format` (LiteLLM's
    `anthropic/` provider and LangChain still send it; Anthropic kept the old name working)."""
    fmt, where = (output_config or {}).get("format"), "output_config.format"
    if not fmt and output_format:
        fmt, where = output_format, "output_format"
    if not fmt:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise ApiError(400, f"{where}.type must be 'json_schema'", param=where)
    param = f"{where}.schema"
    return _grammar(_schema(fmt.get("schema"), param), param)


def ollama_grammar(fmt: str | dict[str, Any] | None) -> str | None:
    """`format`: "json" (any JSON object) or a JSON schema."""
    if not fmt:
        return None
    if fmt == "json":
        return json_schema_grammar(JSON_OBJECT_SCHEMA)
    if isinstance(fmt, dict):
        return _grammar(fmt, "format")
    raise ApiError(400, f'format must be "json" or a JSON schema, got {fmt!r}')


def _grammar(schema: dict[str, Any], param: str) -> str:
    """A client's schema as a grammar; one the engine cannot convert is a 400."""
    try:
        return json_schema_grammar(schema)
    except GrammarError as error:
        raise ApiError(400, str(error), param=param) from error


def _schema(schema: Any, param: str) -> dict[str, Any]:
    if not isinstance(schema, dict):
        raise ApiError(400, f"{param} needs a JSON schema (an object)", param=param)
    return schema
