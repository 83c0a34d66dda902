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


LOGGER_NAMED = re.compile(r"getLogger\(\"(mlxkv(?:\.[A-Za-z_][A-Za-z0-9_]*)*)\"\)")
LOGGER_DEFINED = re.compile(r"^\w+ = logging\.getLogger\(\"(mlxkv[A-Za-z0-9_.]*)\"\)")


def _logger_names(sources: list[Path], pattern: re.Pattern) -> list[tuple[str, str]]:
    return [
        (f"{path.name}:{number}", name)
        for path in sources
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for name in pattern.findall(line)
    ]


def _loggers_defined() -> set[str]:
    """The package's loggers: each module's `getLogger(__name__)`, and the names modules define
    for a log of their own (`mlxkv.server.access`)."""
    defined = set()
    for path in sorted((ROOT / "mlxkv").rglob("*.py")):
        text = path.read_text()
        if "getLogger(__name__)" in text:
            defined.add(".".join(path.relative_to(ROOT).with_suffix("").parts))
        defined.update(name for _, name in _logger_names([path], LOGGER_DEFINED))
    return defined


def _loggers_named(sources: list[Path]) -> list[str]:
    """Each `getLogger("mlxkv...")` naming neither a logger the package logs on nor a parent of
    one: setting its level (to quiet or show a module's lines) does nothing, and the lines it
    meant stay on or off."""
    defined = _loggers_defined()
    return [
        f"{where}: {name}"
        for where, name in _logger_names(sources, LOGGER_NAMED)
        if not any(logger == name or logger.startswith(name + ".") for logger in defined)
    ]


def test_every_logger_named_by_a_literal_exists():
    examples = sorted(ROOT.glob("examples/*.py"))
    sources = [*_sources(), *examples, *sorted(ROOT.glob("benchmarks/*.py"))]
    wrong = _loggers_named(sources)
    assert not wrong, "loggers the package never logs on:\n" + "\n".join(wrong)


def test_the_logger_check_sees_a_stale_name(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(
        'getLogger("mlxkv.runner.prompt_cache.pool")\ngetLogger("mlxkv.server.access")\n'
        'getLogger("mlxkv.server")\ngetLogger("mlxkv.cache.gone")\ngetLogger("mlxkv.cache.prefix")\n'
    )
    wrong = _loggers_named([script])
    assert wrong == ["script.py:4: mlxkv.cache.gone", "script.py:5: mlxkv.cache.prefix"]


CITED_PATH = re.compile(r"(?<![\w/.])((?:mlxkv|tests|benchmarks|examples)/[\w/]+\.py)\b")


def _missing_paths(sources: list[Path]) -> list[str]:
    """Each repository file path (`mlxkv/platform/blas.py`) cited that no file has."""
    return [
        f"{path.name}:{number}: {cited}"
        for path in sources
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for cited in CITED_PATH.findall(line)
        if not (ROOT / cited).is_file()
    ]


def test_every_cited_file_path_exists():
    missing = _missing_paths([*_sources(), ROOT / ".ci" / "run"])
    assert not missing, "cited paths with no file:\n" + "\n".join(missing)


def test_the_path_check_sees_a_stale_path(tmp_path):
    doc = tmp_path / "run"
    doc.write_text("see mlxkv/platform/blas.py\n(see mlxkv/_blas.py); https://x.org/mlxkv/y.py\n")
    assert _missing_paths([doc]) == ["run:2: mlxkv/_blas.py"]
