"""Every dotted name the docs cite in backticks (`mlxkv.runner.prompt_cache.pool`,
`mlxkv.config.ENVIRONMENT`) resolves: in module docstrings and comments, the README and docs/.
A move or a rename that leaves a pointer behind fails here instead of misleading a reader."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import mlxkv

ROOT = Path(mlxkv.__file__).parent.parent
CITED = re.compile(r"`(mlxkv(?:\.[A-Za-z_][A-Za-z0-9_]*)+)(?:\(\))?`")


def _sources() -> list[Path]:
    return [
        *sorted((ROOT / "mlxkv").rglob("*.py")),
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
    ]


def _resolves(name: str) -> bool:
    """Whether `name` is a module, or an attribute path inside the longest module it starts
    with."""
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            if not hasattr(target, attribute):
                return False
            target = getattr(target, attribute)
        return True
    return False


def _unresolved(sources: list[Path]) -> list[str]:
    wrong = []
    for path in sources:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for name in CITED.findall(line):
                if not _resolves(name):
                    wrong.append(f"{path.name}:{number}: {name}")
    return wrong


def test_every_cited_dotted_name_resolves():
    wrong = _unresolved(_sources())
    assert not wrong, "cited names that do not resolve:\n" + "\n".join(wrong)


def test_the_check_sees_a_stale_name(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("`mlxkv.runner.runner.Runner`, `mlxkv.config.ENVIRONMENT`\n`mlxkv.engine.x`\n")
    assert _unresolved([doc]) == ["doc.md:2: mlxkv.engine.x"]
