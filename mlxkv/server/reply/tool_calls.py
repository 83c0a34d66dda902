"""Finding tool calls in generated text as it streams, with mlx-lm's parser for the model.

Owns: `BareCallReader`, which reads a forced call written as a bare JSON object (a model
with no tool-call format, `forced_tools`), and `ToolCallSplitter`, which splits streamed text
into plain text and `ToolCall`s at the model's tool-call markers (mlx-lm's
`TokenizerWrapper.tool_call_start` / `tool_call_end`) and parses each call with the model's
parser (`mlx_lm.tool_parsers`). Does not own the API formats.

Text that only might begin a start marker is held back until it is known, so a client never
sees half a marker. A call that cannot be parsed (cut off by max_tokens, malformed) comes back
as plain text with a warning: nothing the model wrote is dropped.

A call keeps the id the model wrote where its parser returns one (Mistral's JSON list, Kimi
K2's `functions.NAME:IDX`), as mlx-lm's own server does: the client sends that id back, and the
next turn's prompt then renders what the model wrote (the cache reuses the whole reply, and
the model reads ids of its own form). Where the parser gives none, the id is made in the shape
the model's chat template takes: Mistral's templates refuse any id but 9 letters and digits
(vLLM makes the same), the rest take any string.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import secrets
import string
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mlxkv.runner.text.stop_strings import partial_suffix_length

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call.

    Attributes:
        id: the id the model wrote, else a fresh one in its template's shape
            (`call_id_maker`).
        name: the function's name.
        arguments: the arguments as a dict (Anthropic's `input`); `arguments_json` is the
            JSON text OpenAI sends.
        written_id: the id as the model wrote it (JSON text if not a string), None where it
            wrote none: part of the reply's token ids, unlike a fresh `id`
            (`turn.call_reply_ids`).
    """

    id: str
    name: str
    arguments: dict[str, Any]
    written_id: str | None = None

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


Piece = str | ToolCall


class ToolCallSplitter:
    """Splits a stream of text into text and tool calls.

    Args:
        start, end: the model's markers; an empty `end` means a call runs to the end of the
            generation.
        parse: mlx-lm's `parse_tool_call(text, tools)`, returning a dict (or list of dicts)
            with "name" and "arguments".
        tools: the request's tool definitions, handed to the parser.
    """

    def __init__(
        self,
        start: str,
        end: str | None,
        parse: Callable[[str, Any], Any],
        tools: Sequence[dict[str, Any]] | None,
    ):
        self._start = start
        self._end = end or ""
        self._parse = parse
        self._tools = tools
        self._ids = call_id_maker(getattr(parse, "__module__", None))
        self._buffer = ""
        self._in_call = False
        self.warns = True  # a call that does not parse is logged (off: a second reading)

    def __deepcopy__(self, memo: dict[int, Any]) -> ToolCallSplitter:
        """A copy reading on its own (each turn of a request, `reply_keyer`'s second reading)
        that shares the tools, read only: copying a 100 KB list took 1 ms a copy, twice a
        turn. Every other field is immutable (functions are shared by a deep copy too)."""
        return copy.copy(self)

    def push(self, text: str) -> list[Piece]:
        """Adds generated text; returns what is now known to be text or a complete call."""
        self._buffer += text
        pieces: list[Piece] = []
        while True:
            if self._in_call:
                at = self._buffer.find(self._end) if self._end else -1
                if at < 0:
                    return pieces
                pieces += self._parsed(self._buffer[:at])
                self._buffer = self._buffer[at + len(self._end) :]
                self._in_call = False
                continue
            at = self._buffer.find(self._start)
            if at < 0:
                hold = partial_suffix_length(self._buffer, (self._start,))
                safe = self._buffer[: len(self._buffer) - hold]
                self._buffer = self._buffer[len(safe) :]
                return pieces + ([safe] if safe else [])
            if at:
                pieces.append(self._buffer[:at])
            self._buffer = self._buffer[at + len(self._start) :]
            self._in_call = True

    def finish(self) -> list[Piece]:
        """What is left at the end of generation: an unterminated call is parsed if it can
        be (a parser without an end marker relies on this), else returned as text."""
        rest, self._buffer = self._buffer, ""
        if not self._in_call:
            return [rest] if rest else []
        self._in_call = False
        return self._parsed(rest, unterminated=True)

    def _parsed(self, body: str, unterminated: bool = False) -> list[Piece]:
        raw = self._start + body + ("" if unterminated else self._end)
        try:
            found = self._parse(body, self._tools)
            found = found if isinstance(found, list) else [found]
            calls = [_tool_call(item, self._ids) for item in found]
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            if self.warns:
                logger.warning("tool call not parsed, returned as text (%s): %.200r", error, raw)
            return [raw]
        return list(calls)


class BareCallReader:
    """Reads a reply that is one call as a bare JSON object, `{"name": ..., "arguments": {...}}`
    (a grammar kept it so): nothing comes out until the end, then the call, or the text as
    written when it does not parse (cut by max_tokens). Same interface as `ToolCallSplitter`.
    """

    def __init__(self) -> None:
        self._ids = call_id_maker(None)
        self._buffer = ""
        self.warns = True  # as `ToolCallSplitter.warns`

    def push(self, text: str) -> list[Piece]:
        self._buffer += text
        return []

    def finish(self) -> list[Piece]:
        text, self._buffer = self._buffer, ""
        if not text:
            return []
        try:
            return [_tool_call(json.loads(text), self._ids)]
        except (ValueError, KeyError, TypeError) as error:
            if self.warns:
                logger.warning("forced tool call not complete, returned as text (%s)", error)
            return [text]


# Mistral's chat templates raise unless an id is 9 letters and digits.
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
_ALPHANUMERIC = string.ascii_letters + string.digits


@dataclass(frozen=True)
class CallIds:
    """The ids a model's chat template takes: `fits` an id the model wrote, `fresh` one made
    where it wrote none (or one its template would refuse)."""

    fits: Callable[[str], bool]
    fresh: Callable[[], str]


def call_id_maker(parser: str | None) -> CallIds:
    """The id rules for mlx-lm's parser module `parser` (e.g. "mlx_lm.tool_parsers.mistral")."""
    if parser == "mlx_lm.tool_parsers.mistral":
        return CallIds(
            lambda text: _MISTRAL_ID.fullmatch(text) is not None,
            lambda: "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9)),
        )
    return CallIds(lambda text: True, lambda: f"call_{uuid.uuid4().hex[:24]}")


def _tool_call(item: Any, ids: CallIds) -> ToolCall:
    name, arguments = item["name"], item.get("arguments", {})
    if isinstance(arguments, str):
        arguments = json.loads(arguments or "{}")
    if not isinstance(name, str) or not isinstance(arguments, dict):
        raise TypeError("a tool call needs a string name and an object of arguments")
    written = item.get("id")
    kept = isinstance(written, str) and written != "" and ids.fits(written)
    # A JSON escape may decode to a lone surrogate, which no response can carry: such a call
    # goes back as the text the model wrote (UnicodeEncodeError is a ValueError).
    json.dumps([name, arguments, written if kept else ""], ensure_ascii=False).encode()
    return ToolCall(
        id=written if kept else ids.fresh(),
        name=name,
        arguments=arguments,
        written_id=written if written is None or isinstance(written, str) else json.dumps(written),
    )
