"""No module in the package is over 450 lines without a reason written in it, none over 500
at all, and no folder holds more than 12 modules: a longer module or a fuller folder holds more
than one concern, and is split, by concern, before it grows further (STYLE.md §2 says split
before 500). These are budgets for a reader (issue 38), so nothing is peeled off, packed by
hand (`# fmt: skip`) or passed by position only to meet them: a module between 450 and 500
lines says why on the line after its docstring, as a comment `# long: <why>`.

A module's length is its lines as `wc -l` counts them, docstrings and comments included. A
folder's modules are its `.py` files other than `__init__.py`; its sub-folders count on their
own.
"""

from __future__ import annotations

import ast
from pathlib import Path

import mlxkv

PACKAGE = Path(mlxkv.__file__).parent
MAX_LINES = 450
MAX_LINES_WITH_REASON = 500
MAX_MODULES = 12


def _has_reason(text: str) -> bool:
    """Whether the module's first line after its docstring is a `# long: <why>` comment."""
    lines = text.splitlines()
    body = ast.parse(text).body
    docstring = body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    after = body[0].end_lineno if docstring else 0
    return after < len(lines) and lines[after].startswith("# long: ")


def _long_modules() -> dict[str, int]:
    """`path` -> lines, for every module over `MAX_LINES` lines without a reason, or over
    `MAX_LINES_WITH_REASON` with one."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        length = len(text.splitlines())
        limit = MAX_LINES_WITH_REASON if _has_reason(text) else MAX_LINES
        if length > limit:
            found[path.relative_to(PACKAGE).as_posix()] = length
    return found


def _full_folders() -> dict[str, int]:
    """`folder` -> modules, for every folder of the package with more than `MAX_MODULES`."""
    found = {}
    for folder in [PACKAGE, *sorted(p.parent for p in PACKAGE.rglob("__init__.py"))]:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        if len(modules) > MAX_MODULES:
            found[folder.relative_to(PACKAGE.parent).as_posix()] = len(modules)
    return found


def test_no_module_is_over_450_lines_without_a_reason():
    over = _long_modules()
    assert not over, (
        f"modules over {MAX_LINES} lines with no '# long: <why>' after their docstring, or "
        f"over {MAX_LINES_WITH_REASON} with one: {over}"
    )


def test_the_check_reads_a_reason_after_the_docstring():
    assert _has_reason('"""What it owns."""\n# long: one lock over the index\nimport os\n')
    assert not _has_reason('"""What it owns."""\nimport os\n# long: too late\n')
    assert not _has_reason('"""What it owns."""\n')
    assert _has_reason("# long: no docstring\nimport os\n")


def test_no_folder_holds_more_than_12_modules():
    full = _full_folders()
    assert not full, f"folders with more than {MAX_MODULES} modules: {full}"
