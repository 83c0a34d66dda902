"""What a tokenizer and its chat template are made of, read once per model: the control
tokens, a copy of the tokenizer that reads their text as text, the variables the template
reads, the largest id the tokenizer gives, and the fewest tokens a text can take, known from
its length without tokenizing it: a prompt that cannot fit the window is refused before its
text is tokenized (a 16 MB message was tokenized whole, seconds of CPU, before its 400).

Owns `control_tokens`, `plain_text_tokenizer`, `template_variables`, `largest_id` (`chat`,
`controls` and `prompt` use them) and `TokenFloor` (`request_builder` refuses with it). Does not own
rendering (`chat.ChatTemplate`) nor the refusal (`request_builder.RequestBuilder`).

Terms:
  floor: a text of B bytes (as the tokenizer's normalizer leaves it) takes at least
    ceil(B / longest) tokens, `longest` being the bytes of the longest token string of the
    vocabulary, added tokens included: a token stands for no more text than its string (one
    byte per character of a byte-level BPE's; a byte-fallback token `<0xNN>` for one byte).

It holds only where no token stands for a run of unknown text and nothing but the normalizer
takes text away: a BPE in which every byte has a token (a byte-level alphabet, or byte
fallback), whose pre-tokenizers only split (no `Removed` behaviour, no whitespace splitter
that drops the spaces), whose added tokens take no spaces beside them (no `lstrip`,
`rstrip`), whose normalizer is none, or one that only adds (Prepend, a Replace by
no shorter text) or a Unicode normal form (computed here by `unicodedata`: `tokenizers`' own
took 18 s on 16 MB). Elsewhere (WordPiece, Unigram, a BPE with an unknown token, another
normalizer, a tokenizer without a `tokenizers` backend) the floor is 0: the prompt is
tokenized whole, as before.
"""

from __future__ import annotations

import json
import math
import sys
import unicodedata
from collections.abc import Iterator
from typing import Any

import jinja2
from jinja2 import TemplateError, meta

from mlxkv.runner.text.messages import is_messages


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


_SPLITTING_PRE_TOKENIZERS = {"ByteLevel", "Split", "Digits", "Metaspace", "Punctuation"}
_NORMAL_FORMS = {"NFC", "NFD", "NFKC", "NFKD"}
# The character a byte-level BPE writes for each byte, by the byte: GPT-2's `bytes_to_unicode`
# (https://github.com/openai/gpt-2/blob/1b8a0187d70a2dbe4de8322598496d476e069f4c/src/encoder.py#L9).
_PRINTED = [*range(33, 127), *range(161, 173), *range(174, 256)]
_BYTE_CHARS = [
    chr(b) if b in _PRINTED else chr(256 + [c for c in range(256) if c not in _PRINTED].index(b))
    for b in range(256)
]


class TokenFloor:
    """The floor of one tokenizer (see the module docstring).

    Args:
        tokenizer: mlx-lm's TokenizerWrapper or a Hugging Face tokenizer.
    """

    def __init__(self, tokenizer: Any):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        described = json.loads(backend.to_str()) if backend is not None else {}
        vocab = backend.get_vocab(with_added_tokens=True) if backend is not None else {}
        forms = _normal_forms(described.get("normalizer"))
        untokenized = _untokenized_bytes(described, vocab)
        added = described.get("added_tokens", ())
        bounded = (
            forms is not None
            and untokenized is not None
            and all(_only_splits(step) for step in _steps(described.get("pre_tokenizer")))
            # an added token that strips the spaces beside it (Phi-3's `<|end|>`) stands for
            # more text than its string: any run of them
            and not any(t.get("lstrip") or t.get("rstrip") for t in added)
        )
        self._forms: list[str] = forms or []
        self._untokenized = untokenized or b""
        # None: no floor can be known for this tokenizer
        self.longest_bytes = max(len(t.encode()) for t in vocab) if bounded and vocab else None

    def prompt_tokens_at_least(
        self, tokenizer: Any, prompt: Any, past: int, **template: Any
    ) -> int:
        """The fewest tokens `prompt` (a text, or chat messages whose content is text) can
        take, its messages rendered by `tokenizer`'s chat template with `template`'s tools and
        switches as text, never tokenized. 0 where it cannot be known, and where the prompt's
        characters cannot make it more than `past` tokens (not rendered: a usual prompt costs
        nothing more). Rendered without the generation prompt, which a continued last message
        lacks."""
        if self.longest_bytes is None or not (isinstance(prompt, str) or is_messages(prompt)):
            return 0
        if isinstance(prompt, str):
            return (
                self.tokens_at_least(prompt) if len(prompt) * 4 > past * self.longest_bytes else 0
            )
        contents = [m.get("content") for m in prompt if isinstance(m, dict)]
        chars = sum(len(c) for c in contents if isinstance(c, str))
        if chars * 4 <= past * self.longest_bytes:
            return 0
        try:
            text = tokenizer.apply_chat_template(
                list(prompt), tokenize=False, add_generation_prompt=False, **template
            )
        except Exception:  # noqa: BLE001 - any refusal is the exact path's to report
            return 0
        return self.tokens_at_least(text) if isinstance(text, str) else 0

    def tokens_at_least(self, text: str) -> int:
        """The fewest tokens `text` can take (0 where the tokenizer allows no floor)."""
        if self.longest_bytes is None:
            return 0
        for form in self._forms:
            text = unicodedata.normalize(form, text)
        encoded = text.encode("utf-8", "surrogatepass")
        if self._untokenized:
            encoded = encoded.translate(None, self._untokenized)
        return math.ceil(len(encoded) / self.longest_bytes)


def _steps(step: Any) -> Iterator[dict[str, Any]]:
    """The steps of a normalizer or pre-tokenizer, nested sequences walked."""
    if isinstance(step, list):
        for s in step:
            yield from _steps(s)
    elif isinstance(step, dict):
        nested = step.get("normalizers") or step.get("pretokenizers")
        if step.get("type") == "Sequence" and nested is not None:
            yield from _steps(nested)
        else:
            yield step


def _normal_forms(normalizer: Any) -> list[str] | None:
    """The Unicode normal forms `normalizer` applies, in order, where its other steps only add
    text; None where a step may take text away (lowercase, strip, a regex replace...)."""
    forms = []
    for step in _steps(normalizer):
        kind = step.get("type")
        if kind in _NORMAL_FORMS:
            forms.append(kind)
        elif kind == "Replace" and "String" in step.get("pattern", {}):
            if len(step.get("content", "").encode()) < len(step["pattern"]["String"].encode()):
                return None
        elif kind != "Prepend":
            return None
    return forms


def _untokenized_bytes(described: dict[str, Any], vocab: dict[str, int]) -> bytes | None:
    """The bytes of text that no token stands for in a BPE without dropout where no token is
    unknown: a byte-level BPE drops a byte whose character is not in its vocabulary (the
    default model's GGUF lacks 21: a few control characters, 0xF1, 0xF2, bytes UTF-8 never
    uses), so they are not counted; a byte-fallback one must have all 256. None where some
    token may stand for a run of unknown text."""
    model = described.get("model", {})
    if model.get("type") != "BPE" or model.get("dropout"):
        return None
    if model.get("byte_fallback"):
        return b"" if all(f"<0x{b:02X}>" in vocab for b in range(256)) else None
    if not any(s.get("type") == "ByteLevel" for s in _steps(described.get("pre_tokenizer"))):
        return None
    return bytes(b for b, char in enumerate(_BYTE_CHARS) if char not in vocab)


def _only_splits(step: dict[str, Any]) -> bool:
    return step.get("type") in _SPLITTING_PRE_TOKENIZERS and step.get("behavior") != "Removed"
