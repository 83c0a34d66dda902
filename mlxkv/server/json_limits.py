"""What a request's JSON may hold, checked on its bytes before anything parses it.

- Depth: Python's JSON parser, pydantic and the chat templates' `tojson` recurse once per
  level; a body nested ~500 levels deep (inside tool schemas or tool-call arguments) ended in
  RecursionError, a 500, on every path. No real tool schema comes near `MAX_JSON_DEPTH`.
- Messages: a 32 MB body of 1.16M tiny messages took the server from 1 to 6 GB while pydantic
  expanded it, for a 400 at the end. `MAX_MESSAGES` is far above a long agent session's.
"""

from __future__ import annotations

import re

import numpy as np

MAX_JSON_DEPTH = 100
MAX_MESSAGES = 10_000
# A message's role key as it appears in the JSON (inside a string it is escaped: \"role\").
_ROLE_KEY = re.compile(rb'"role"\s*:')
# JSON strings, whose brackets are text (escaped quotes included).
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_STEP = np.zeros(256, dtype=np.int8)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1


def json_depth(data: bytes | str) -> int:
    """The deepest nesting of arrays and objects in JSON text (0 for a scalar); text that is
    not JSON gives a number without meaning, which the parser then refuses anyway."""
    raw = data.encode() if isinstance(data, str) else data
    brackets = np.frombuffer(_STRINGS.sub(b'""', raw), dtype=np.uint8)
    if brackets.size == 0:
        return 0
    return int(np.cumsum(_STEP[brackets], dtype=np.int64).max(initial=0))


def too_deep_message(depth: int, what: str) -> str:
    return (
        f"{what} nests {depth} levels deep; this server takes at most {MAX_JSON_DEPTH} levels "
        "of arrays and objects"
    )


def message_count(data: bytes) -> int:
    """About how many messages (objects with a "role") the JSON body holds."""
    return len(_ROLE_KEY.findall(data))
