"""Rendered chat text to token ids, one segment at a time, each segment's ids kept for the
next turn.

Owns `SegmentEncoder` and `KeptIds` (text to ids, the latest texts' ids kept). An agent's
turn re-renders its whole conversation (tens of thousands of tokens, most of them the same
system prompt and tool results as last turn) and tokenizing it was most of a cached turn's
host time; rendering the text costs about a millisecond.

Terms:
  segment: a stretch of rendered text that begins at an added token (`<|im_start|>`, ...) and
    runs to the next one (the first runs from the start of the text). A `tokenizers` backend
    cuts the text at every added token before it normalizes, pre-tokenizes and runs the model
    on what is between, each stretch on its own; so the ids of the text are the ids of its
    segments, joined, and a segment seen before takes the ids it had then.

Exact only where the backend does cut that way; `SegmentEncoder` checks the tokenizer's own
description for what reaches across a cut (an added token that strips the whitespace beside
it or is matched after normalizing) and for any of it, or a tokenizer without a `tokenizers`
backend, encodes the text whole, as before. So it does, to be safe, for one that adds a
prefix (Metaspace, Prepend: sentencepiece-style, whose first stretch may be treated apart);
a segment begins with its added token, so no later stretch is first either way, but these
tokenizers' Python-side options were not all checked.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

# Characters of text whose ids are kept, least recently used dropped first: ten or more agent
# conversations (100-400k characters each); about 10 bytes a character with the ids.
MAX_KEPT_CHARS = 4 * 1024 * 1024


class SegmentEncoder:
    """Text to ids without special tokens added (`tokenizer.encode(text,
    add_special_tokens=False)`), by segments, each kept once encoded.

    Thread-safe (`KeptIds`).

    Args:
        tokenizer: mlx-lm's TokenizerWrapper or a Hugging Face tokenizer.
    """

    def __init__(self, tokenizer: Any, max_kept_chars: int = MAX_KEPT_CHARS):
        self._tokenizer = tokenizer
        self._backend, added = _cutting_backend(tokenizer)
        # Longest first: at one position the longest added token wins, as in the backend.
        pattern = "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True))
        self._starts = re.compile(pattern) if pattern else None
        if self._backend is not None:
            backend = self._backend
            # The batch call releases the GIL while it runs (`encode` holds it: a 16 MB message
            # stopped every other thread, the server's event loop too, for 34 s), and skips
            # the offsets nobody reads: the same ids, faster.
            self._segment_ids = KeptIds(
                lambda segment: (
                    backend.encode_batch_fast([segment], add_special_tokens=False)[0].ids
                ),
                max_kept_chars,
            )

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, equal to encoding it whole (a new list, the caller's)."""
        if self._backend is None:
            return list(self._tokenizer.encode(text, add_special_tokens=False))
        ids: list[int] = []
        for segment in self._segments(text):
            ids += self._segment_ids(segment)
        return ids

    def _segments(self, text: str) -> list[str]:
        if self._starts is None:
            return [text]
        cuts = [m.start() for m in self._starts.finditer(text) if m.start() > 0]
        return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


class KeptIds:
    """`encode(text)` for texts seen again and again: the ids of the latest texts, up to
    `max_kept_chars` characters of them, are kept, least recently used dropped first.
    Thread-safe: the kept ids are shared under a lock; encoding runs outside it.

    Args:
        encode: text -> ids, the same ids each time for the same text (None: every caller
            passes its own to `kept`).
        max_kept_chars: the bound on the keys kept: characters of str keys, bytes of bytes.
    """

    def __init__(
        self,
        encode: Callable[[str], list[int]] | None,
        max_kept_chars: int = MAX_KEPT_CHARS,
    ):
        self._encode = encode
        self._max_kept_chars = max_kept_chars
        self._kept_chars = 0
        self._kept: OrderedDict[str | bytes, list[int]] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, text: str) -> list[int]:
        """The ids of `text` (kept ones: not to be changed by the caller)."""
        return self.kept(text, lambda: self._encode(text))

    def kept(self, key: str | bytes, encode: Callable[[], list[int]]) -> list[int]:
        """The ids kept for `key`, else `encode()`'s, kept (not to be changed by the caller).
        `key` must say everything `encode()` depends on."""
        with self._lock:
            ids = self._kept.get(key)
            if ids is not None:
                self._kept.move_to_end(key)
                return ids
        ids = encode()
        with self._lock:
            if key not in self._kept:  # another thread may have kept it meanwhile
                self._kept[key] = ids
                self._kept_chars += len(key)
            while self._kept_chars > self._max_kept_chars:
                dropped, _ = self._kept.popitem(last=False)
                self._kept_chars -= len(dropped)
        return ids


def _cutting_backend(tokenizer: Any) -> tuple[Any, list[str]]:
    """The tokenizer's `tokenizers` backend and its added tokens' strings when it cuts text at
    added tokens and treats each stretch alike wherever it stands, else (None, [])
    (see the module docstring)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    # truncation or padding set in the tokenizer's file would apply to each segment (the
    # Python tokenizer switches them off around its own encode calls)
    if backend is None or backend.encode_special_tokens or backend.truncation or backend.padding:
        return None, []
    described = json.loads(backend.to_str())
    added = described.get("added_tokens", [])
    flags = ("normalized", "lstrip", "rstrip", "single_word")
    if any(token.get(flag) for token in added for flag in flags):
        return None, []
    if _first_only(described.get("pre_tokenizer")) or _first_only(described.get("normalizer")):
        return None, []
    return backend, [token["content"] for token in added if token["content"]]


def _first_only(step: Any) -> bool:
    """Whether a normalizer or pre-tokenizer (nested sequences walked) adds a prefix, which
    `tokenizers` may add to the text's first stretch alone (Metaspace, Prepend)."""
    if isinstance(step, list):
        return any(_first_only(s) for s in step)
    if not isinstance(step, dict):
        return False
    if step.get("type") == "Prepend":
        return True
    if step.get("type") == "Metaspace" and step.get("prepend_scheme", "always") != "never":
        return True
    return any(_first_only(step.get(key)) for key in ("pretokenizers", "normalizers"))
