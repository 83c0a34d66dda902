"""Constrained decoding: whatever a model would rather say, the output keeps to the grammar:
JSON that parses and validates against its schema, also where speculative decoding was asked
for, on every architecture; a schema the engine cannot compile is a ValueError naming it."""

from __future__ import annotations

import json
import math

import pytest

from mlxkv import json_schema_grammar

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "sunny": {"type": "boolean"},
        "rank": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["city", "sunny", "rank"],
    "additionalProperties": False,
}
CHAT = [{"role": "user", "content": "The weather in a European capital, as JSON."}]


def _valid(value: dict) -> bool:
    return (
        set(value) == {"city", "sunny", "rank"}
        and value["city"] in ("Paris", "Rome", "Oslo")
        and isinstance(value["sunny"], bool)
        and isinstance(value["rank"], int)
        and 0 <= value["rank"] <= 9
    )


@pytest.mark.parametrize("arch", ["llama", "qwen3", "lfm2"])
@pytest.mark.parametrize("speculative", ["off", "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_the_output_parses_and_validates(make_runner, arch, speculative, temperature):
    runner = make_runner(arch, max_context=512)
    out = runner.generate(
        CHAT,
        grammar=json_schema_grammar(SCHEMA),
        speculative=speculative,
        temperature=temperature,
        seed=3,
        max_tokens=60,
    )
    assert out.finish_reason == "stop", out.text
    assert _valid(json.loads(out.text)), out.text
    assert out.drafted_tokens == 0  # drafting is off under a grammar


def test_without_the_grammar_the_model_says_something_else(make_runner):
    """The tiny random model never writes this JSON on its own: the grammar did it."""
    out = make_runner("llama").generate(CHAT, max_tokens=30)
    with pytest.raises(ValueError):
        _valid(json.loads(out.text))


def test_a_schema_the_engine_cannot_compile_is_a_value_error(make_runner):
    runner = make_runner("llama")
    bad = json_schema_grammar({"type": "object", "properties": {"a": {"type": "nonsense"}}})
    with pytest.raises(ValueError, match="cannot be used: .*nonsense"):
        runner.generate(CHAT, grammar=bad, max_tokens=5)
    assert runner.cache_tokens == []  # refused before anything ran


def test_logprobs_under_a_grammar_are_finite(make_runner):
    """Alternatives the grammar rules out are left out (their -inf made a 500 and invalid
    JSON in the stream)."""
    runner = make_runner("llama", max_context=512)
    chunks = list(runner.stream(CHAT, grammar=json_schema_grammar(SCHEMA), logprobs=5,
                                max_tokens=60))  # fmt: skip
    reported = [c.logprob for c in chunks if c.logprob is not None]
    assert reported and all(math.isfinite(r.logprob) for r in reported)
    assert all(math.isfinite(v) for r in reported for _, v in r.top)
    assert any(len(r.top) < 5 for r in reported)  # the grammar allowed fewer than 5 there


def test_an_integer_without_bounds_ends_at_16_digits(make_runner):
    """A model that writes digits for ever (one digit's logit raised) under a schema whose
    integer sets no bounds: the number ends at 16 digits (+-(2**53 - 1)) and the output
    validates; before, it ran to `max_tokens` and never parsed. A bound the schema sets is
    kept, and one past 2**53 moves the other side's (`bounded_integers`)."""
    runner = make_runner("llama")
    (nine,) = runner.tokenizer.encode("9", add_special_tokens=False)
    options = {"max_tokens": 40, "temperature": 0.0, "logit_bias": {nine: 100.0}}
    out = runner.generate(CHAT, grammar=json_schema_grammar({"type": "integer"}), **options)
    assert (json.loads(out.text), out.finish_reason) == (999999999999999, "stop")  # < 2**53
    wider = json_schema_grammar({"type": "integer", "maximum": 10**17})
    assert json.loads(runner.generate(CHAT, grammar=wider, **options).text) == int("9" * 17)
    above = json_schema_grammar({"type": "integer", "minimum": 10**16})  # not emptied
    out = runner.generate(CHAT, grammar=above, **options)
    assert 10**16 <= json.loads(out.text) <= 10**16 + 2**53 and out.finish_reason == "stop"
