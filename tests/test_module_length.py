"""No module in the package is over 450 lines and no folder holds more than 12 modules: a longer
module or a fuller folder holds more than one concern, and is split, by concern, before it grows
further (STYLE.md §2 says split before 500). These are budgets for a reader, so nothing is
peeled off only to meet them: a split must make each part say one thing.

A module's length is its lines as `wc -l` counts them, docstrings and comments included. A
folder's modules are its `.py` files other than `__init__.py`; its sub-folders count on their
own.
"""

from __future__ import annotations

from pathlib import Path

import mlxkv

PACKAGE = Path(mlxkv.__file__).parent
MAX_LINES = 450
MAX_MODULES = 12


def _long_modules() -> dict[str, int]:
    """`path` -> lines, for every module over `MAX_LINES` lines."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        length = len(path.read_text().splitlines())
        if length > MAX_LINES:
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


def test_no_module_is_over_450_lines():
    over = _long_modules()
    assert not over, f"modules over {MAX_LINES} lines: {over}"


def test_no_folder_holds_more_than_12_modules():
    full = _full_folders()
    assert not full, f"folders with more than {MAX_MODULES} modules: {full}"
