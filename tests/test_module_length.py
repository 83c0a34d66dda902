"""No module in the package is over 400 lines (issue 25): a longer one holds more than one
concern, and is split before it grows further (STYLE.md §2).

A module's length is its lines as `wc -l` counts them, docstrings and comments included.
"""

from __future__ import annotations

from pathlib import Path

import mlxkv

PACKAGE = Path(mlxkv.__file__).parent
MAX_LINES = 400


def _long_modules() -> dict[str, int]:
    """`path` -> lines, for every module over `MAX_LINES` lines."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        length = len(path.read_text().splitlines())
        if length > MAX_LINES:
            found[path.relative_to(PACKAGE).as_posix()] = length
    return found


def test_no_module_is_over_400_lines():
    over = _long_modules()
    assert not over, f"modules over {MAX_LINES} lines: {over}"
