"""What a request's JSON may hold, checked on its bytes before anything parses it, in one
vectorized pass (linear in the body: a regex over strings was quadratic on a body of
unclosed quotes and froze the event loop for half a minute on 128 KB).

- Depth: Python's JSON parser, pydantic and the chat templates' `tojson` recurse once per
  level; a body nested ~500 levels deep (inside tool schemas or tool-call arguments) ended in
  RecursionError, a 500, on every path. No real tool schema comes near `MAX_JSON_DEPTH`.
- Values: a 32 MB body of 1.16M tiny messages took the server from 1 to 6 GB while pydantic
  expanded it, for a 400 at the end; so did half a million Responses items, or one message of
  900,000 empty blocks. `MAX_JSON_VALUES` (objects, arrays and the elements they separate)
  is far above a long agent session's, while a long text in one string counts once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_JSON_DEPTH = 100
MAX_JSON_VALUES = 200_000
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_STEP = np.zeros(256, dtype=np.int8)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1
_SEPARATES = np.zeros(256, dtype=bool)
_SEPARATES[list(b"[{,")] = True
_STRUCTURAL = _SEPARATES.copy()
_STRUCTURAL[list(b"]}")] = True


@dataclass(frozen=True)
class JsonShape:
    """depth: the deepest nesting of arrays and objects (0 for a scalar); values: containers
    and the separators between elements, outside strings. Text that is not JSON gives numbers
    without meaning, which the parser then refuses anyway."""

    depth: int
    values: int


def json_shape(data: bytes | str) -> JsonShape:
    raw = np.frombuffer(data.encode() if isinstance(data, str) else data, dtype=np.uint8)
    structural = np.flatnonzero(_STRUCTURAL[raw])
    if structural.size == 0:
        return JsonShape(0, 0)
    quotes = np.flatnonzero(raw == _QUOTE)
    # A quote after an odd run of backslashes is text: find the runs before quotes only.
    backslash = raw == _BACKSLASH
    after = quotes[(quotes > 0) & backslash[np.maximum(quotes - 1, 0)]]
    if after.size:
        run_starts = np.flatnonzero(backslash & ~np.concatenate(([False], backslash[:-1])))
        starts = run_starts[np.searchsorted(run_starts, after - 1, side="right") - 1]
        quotes = np.setdiff1d(quotes, after[(after - starts) % 2 == 1], assume_unique=True)
    # Outside strings: after an even number of real quotes.
    outside = np.searchsorted(quotes, structural) % 2 == 0
    kinds = raw[structural[outside]]
    depth = int(np.cumsum(_STEP[kinds], dtype=np.int64).max(initial=0))
    values = int(np.count_nonzero(_SEPARATES[kinds]))
    return JsonShape(max(depth, 0), values)


def json_depth(data: bytes | str) -> int:
    return json_shape(data).depth


def too_deep_message(depth: int, what: str) -> str:
    return (
        f"{what} nests {depth} levels deep; this server takes at most {MAX_JSON_DEPTH} levels "
        "of arrays and objects"
    )


def too_many_message(values: int) -> str:
    return (
        f"the request holds {values:,} JSON objects, arrays and elements; this server takes "
        f"at most {MAX_JSON_VALUES:,} per request"
    )
