"""What a tokenizer and its chat template are made of, read once per model: the control
tokens, a copy of the tokenizer that reads their text as text, the variables the template
reads, and the largest id the tokenizer gives.

Owns `control_tokens`, `plain_text_tokenizer`, `template_variables` and `largest_id` (`chat` and
`prompt` use them).
"""

from __future__ import annotations

import sys
from typing import Any

import jinja2
from jinja2 import TemplateError, meta


def template_variables(template: Any) -> frozenset[str]:
    """The undeclared variables a chat template's source reads (none if it does not parse)."""
    if not isinstance(template, str):
        return frozenset()
    try:
        return frozenset(meta.find_undeclared_variables(jinja2.Environment().parse(template)))
    except TemplateError:
        return frozenset()


def control_tokens(hf_tokenizer: Any) -> list[str]:
    """The strings of the tokenizer's special added tokens."""
    decoder = getattr(hf_tokenizer, "added_tokens_decoder", None) or {}
    return [t.content for t in decoder.values() if getattr(t, "special", False) and t.content]


def plain_text_tokenizer(hf_tokenizer: Any) -> Any:
    """A copy of the fast tokenizer that tokenizes control-token strings as plain text, or
    None for tokenizers without a `tokenizers` backend."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    from tokenizers import Tokenizer

    plain = Tokenizer.from_str(backend.to_str())
    plain.encode_special_tokens = True
    return plain


def largest_id(tokenizer: Any) -> int:
    """The largest id the tokenizer gives (added tokens included); unbounded if it cannot
    say."""
    vocabulary = getattr(tokenizer, "get_vocab", None)
    try:
        return max(vocabulary().values()) if vocabulary is not None else sys.maxsize
    except (TypeError, ValueError, AttributeError):
        return sys.maxsize
