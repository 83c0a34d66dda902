"""Constrained decoding: every sampled token keeps the output inside a grammar, so a reply
asked for as JSON (OpenAI's `response_format`, Anthropic's `output_config.format`, Ollama's
`format`) always parses and validates, whatever the model would rather say.

Owns `check_grammar` (before a request runs) and `grammar_processor` (the logits processor
that masks what the grammar does not allow next). The grammar engine is llguidance, which
llama.cpp and vLLM use; a grammar is its JSON form (`json_schema_grammar` builds one from a
JSON schema) or its Lark form.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import mlx.core as mx
import numpy as np

from mlxkv.decoding.sampling import LogitsProcessor
from mlxkv.decoding.schema_recursion import check_finite_schema
from mlxkv.errors import GrammarError

# OpenAI's `{"type": "json_object"}`: any JSON object.
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}
# The bound of an integer whose schema sets none on a side (`bounded_integers`): JSON's safe
# integers (I-JSON, JavaScript's Number.MAX_SAFE_INTEGER), 16 digits.
MAX_SAFE_INTEGER = 2**53 - 1
# Keywords whose values are JSON data, not schemas (a "$ref" in them is not a pointer); and
# those whose values name schemas (a name, "default" or "$ref", is not a keyword).
DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
NAMED_SCHEMAS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"}
)


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """The grammar of JSON text that validates against `schema`, compact (no free whitespace
    between tokens: a small model cannot wander into pages of spaces), its integers bounded
    (`bounded_integers`).

    Raises:
        GrammarError: a schema llguidance cannot convert (a bound past 64-bit integers).
    """
    from llguidance import LLMatcher

    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    try:
        return LLMatcher.grammar_from_json_schema(bounded_integers(schema), defaults=options)
    except ValueError as error:
        raise GrammarError(f"the JSON schema cannot be used: {_shortened(error)}") from None


def bounded_integers(schema: Any) -> Any:
    """`schema` with each integer that sets no bound on a side bounded there by
    +-`MAX_SAFE_INTEGER` (that far past the other side's bound where it lies beyond: a range
    is never emptied): an unbounded integer lets a small model write digits until
    `max_tokens` (SmolLM2 on pydantic-ai's `population: int`: `3121000000000...`, no call
    made), where after 16 digits the grammar now ends the number. A value past 2**53 is not
    exact in most JSON readers anyway; any value it allows validates against `schema`."""
    if isinstance(schema, list):
        return [bounded_integers(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    bounded = {
        key: value
        if key in DATA_KEYWORDS
        else {name: bounded_integers(sub) for name, sub in value.items()}
        if key in NAMED_SCHEMAS and isinstance(value, dict)
        else bounded_integers(value)
        for key, value in schema.items()
    }
    kind = schema.get("type")
    if kind == "integer" or (isinstance(kind, list) and "integer" in kind):
        low, high = _bound(schema, "minimum"), _bound(schema, "maximum")
        if not schema.keys() & {"minimum", "exclusiveMinimum"}:
            beyond = high <= -MAX_SAFE_INTEGER
            bounded["minimum"] = (high if beyond else 0) - MAX_SAFE_INTEGER
        if not schema.keys() & {"maximum", "exclusiveMaximum"}:
            beyond = low >= MAX_SAFE_INTEGER
            bounded["maximum"] = (low if beyond else 0) + MAX_SAFE_INTEGER
    return bounded


def _bound(schema: dict[str, Any], keyword: str) -> int:
    """The integer bound `schema` sets by `keyword` or its exclusive form (a number; draft
    4's boolean is a flag), else 0."""
    for key in (keyword, "exclusive" + keyword.capitalize()):
        value = schema.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return int(value)
    return 0


def check_grammar(grammar: str, tokenizer: Any) -> None:
    """Raises:
    ValueError: a grammar llguidance cannot compile for this tokenizer (mlx-lm's
        TokenizerWrapper), or a JSON schema whose recursion cannot end (it compiles, but
        nothing matches it: `schema_recursion`); the message names the problem.
    """
    from llguidance import LLMatcher

    if not isinstance(grammar, str) or not grammar:
        raise ValueError(f"grammar must be a non-empty str, got {grammar!r}")
    problem = LLMatcher.validate_grammar(grammar, _llguidance_tokenizer(tokenizer))
    if problem:
        raise ValueError(f"the grammar (or JSON schema) cannot be used: {problem}")
    for schema in _json_schemas(grammar):
        check_finite_schema(schema)


def grammar_processor(
    grammar: str, tokenizer: Any, vocab_size: int, prompt_tokens: int
) -> LogitsProcessor:
    """A logits processor for one generation whose token history starts with `prompt_tokens`
    prompt tokens: it feeds each generated token to the grammar and masks every token the
    grammar does not allow next (`vocab_size`: the logits' width, which may exceed the
    tokenizer's; the extra ids are never allowed). The grammar's end allows only EOS."""
    from llguidance import LLMatcher
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    ll_tokenizer = _llguidance_tokenizer(tokenizer)
    matcher = LLMatcher(ll_tokenizer, grammar)
    words = allocate_token_bitmask(1, ll_tokenizer.vocab_size)
    width = min(vocab_size, ll_tokenizer.vocab_size)
    fed = prompt_tokens

    def constrain(history: mx.array, logits: mx.array) -> mx.array:
        nonlocal fed
        new = history[fed:].tolist()  # waits for the last token: the mask depends on it
        fed += len(new)
        # A stopped matcher has seen the grammar's end (EOS): decoding computes one step past
        # the last token before it sees the end, and that step's token is never kept.
        if new and not matcher.is_stopped() and not matcher.consume_tokens(new):
            # the mask allowed the token: the engine gave up (its limits, reached mid-reply)
            raise GrammarError(
                "the grammar (or JSON schema) cannot be followed: "
                f"{_shortened(matcher.get_error())}; simplify it"
            )
        fill_next_token_bitmask(matcher, words)
        allowed = np.zeros(vocab_size, dtype=bool)
        allowed[:width] = np.unpackbits(words.view(np.uint8), bitorder="little")[:width]
        return mx.where(mx.array(allowed), logits, -mx.inf)

    return constrain


def _shortened(problem: Any, max_chars: int = 300) -> str:
    """llguidance's message, bounded: it quotes the schema's values (a 300-digit bound) and
    may append its parser's state (`<state>`: its counters, of no use to a client)."""
    text = str(problem).split("\n<state>")[0]
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


def _json_schemas(grammar: str) -> list[Any]:
    """The JSON schemas of a grammar in llguidance's JSON form (none for Lark text)."""
    try:
        spec = json.loads(grammar)
    except json.JSONDecodeError:
        return []
    grammars = spec.get("grammars") if isinstance(spec, dict) else None
    return [g["json_schema"] for g in grammars or [] if isinstance(g, dict) and "json_schema" in g]


@functools.lru_cache(maxsize=4)
def _llguidance_tokenizer(tokenizer: Any) -> Any:
    """The tokenizer as llguidance reads it (its Rust tokenizer's JSON); about a second to
    build, so kept per tokenizer."""
    from llguidance import LLTokenizer

    backend = tokenizer.backend_tokenizer  # the Hugging Face fast tokenizer's Rust side
    return LLTokenizer(backend.to_str(), eos_token=sorted(tokenizer.eos_token_ids))
