"""No function in the package is over 60 lines without a reason written beside it (issue 25).

A function's length is its lines from `def` to its last line, its docstring included
(decorators not). A longer one carries its reason on the line just before its `def` (or its
first decorator): a comment `# long: <why>`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import mlxkv

PACKAGE = Path(mlxkv.__file__).parent
MAX_LINES = 60


def _long_functions() -> dict[str, int]:
    """`path:name` -> lines, for every function over `MAX_LINES` lines without a reason."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            length = node.end_lineno - node.lineno + 1
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            before = lines[first - 2].strip() if first >= 2 else ""
            if length > MAX_LINES and not before.startswith("# long:"):
                found[f"{path.relative_to(PACKAGE).as_posix()}:{node.name}"] = length
    return found


def test_no_function_is_over_60_lines_without_a_reason():
    over = _long_functions()
    assert not over, f"functions over {MAX_LINES} lines with no '# long: <why>' before them: {over}"
