"""Every `mlxkv` command line and `python -m benchmarks.*` line the README and docs/ show takes
the options it is shown with, and a usage line's `[--flag VALUE]` with a literal value shows
the default `--help` gives: a renamed flag or a changed default fails here instead of in a new
user's terminal. README's list of `Runner.load` keywords is every `RunnerConfig` field with its
default, and docs/server.md's fields of `GET /v1/mlxkv/cache` are those it returns.
(tests/test_doc_references.py does the same for dotted names.)"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from mlxkv.cli.parser import build_parser
from mlxkv.config import RunnerConfig, parse_bytes
from mlxkv.runner.prompt_cache.report import EntryReport, MemoryReport

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"\bmlxkv (generate|chat|serve|convert|info)\b(.*)")
BENCHMARK = re.compile(r"python -m benchmarks\.([a-z_]+)([^`]*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z-]*)")
# `[--port 8080]`, `[--cache-dir-bytes 16GiB]`: a value with a digit or in lower case is a
# literal (the default); `[--max-tokens N]` and `[--speculative auto|ngram]` are not.
BRACKETED = re.compile(r"\[(--[a-z-]+) ([^\]\s|]+)\]")
DEFAULT = re.compile(r"\(default: ([^)]*)\)")
# A benchmark's option it refuses to run without (argparse's `required=True`, or its own check).
REQUIRED = re.compile(
    r'add_argument\(\s*"(--[a-z-]+)"[^)]*required=True|parser\.error\(\s*f?"(--[a-z-]+)[^"]*required'
)


def _lines(path: Path) -> list[tuple[str, str]]:
    """(place, text) for each command in `path`: fenced lines, a usage line's indented `[...]`
    and `\\` continuations joined to it, and inline code spans."""
    found = []
    fenced = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        place = f"{path.name}:{number}"
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            found += [(place, span) for span in re.findall(r"`([^`]+)`", line)]
            continue
        text = line.split(" # ")[0].split("   #")[0]
        if found and (re.match(r"\s+\[", text) or found[-1][1].endswith("\\")):
            found[-1] = (found[-1][0], found[-1][1].rstrip("\\") + " " + text.strip())
        else:
            found.append((place, text))
    return found


def _help(command: str, capsys) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    return capsys.readouterr().out


def _option_defaults(help_text: str) -> dict[str, str | None]:
    """Each option of a `--help` text and the default it shows (None: none shown)."""
    options = {}
    for entry in re.split(r"\n(?=  -)", help_text):
        entry = " ".join(entry.split())
        names = re.findall(r"^(?:-[a-z] \S+, |-[a-z], )?(--[a-z][a-z-]*)", entry)
        default = DEFAULT.search(entry)
        for name in names:
            options[name] = default.group(1) if default else None
    return options


def _same_value(shown: str, default: str | None) -> bool:
    if default is None:
        return False
    if shown == default:
        return True
    try:
        return parse_bytes(shown) == parse_bytes(default)
    except ValueError:
        return False


def _command_problems(capsys) -> list[str]:
    helps = {}
    problems = []
    for path in DOCS:
        for place, text in _lines(path):
            for match in COMMAND.finditer(text):
                command, rest = match.groups()
                if command not in helps:
                    helps[command] = _option_defaults(_help(command, capsys))
                options = helps[command]
                for flag in FLAG.findall(rest):
                    if flag not in options and flag not in ("--help", "--version"):
                        problems.append(f"{place}: mlxkv {command} has no {flag}")
                for flag, value in BRACKETED.findall(rest):
                    literal = any(c.isdigit() for c in value) or value.islower()
                    if literal and not _same_value(value, options.get(flag)):
                        shown = options.get(flag)
                        problems.append(f"{place}: {flag} {value}, but --help says {shown}")
    return problems


def _benchmark_problems() -> list[str]:
    problems = []
    for path in DOCS:
        for place, text in _lines(path):
            for module, rest in BENCHMARK.findall(text):
                source = ROOT / "benchmarks" / f"{module}.py"
                if not source.exists():
                    problems.append(f"{place}: no benchmarks/{module}.py")
                    continue
                code = source.read_text()
                shown = FLAG.findall(rest)
                problems += [
                    f"{place}: benchmarks.{module} has no {flag}"
                    for flag in shown
                    if f'"{flag}"' not in code
                ]
                # (a module with subcommands: their options are the subcommand's business)
                required = [] if "add_subparsers" in code else REQUIRED.findall(code)
                problems += [
                    f"{place}: benchmarks.{module} needs {option or check}"
                    for option, check in required
                    if (option or check) not in shown
                ]
    return problems


def test_every_documented_mlxkv_command_takes_its_options_and_shows_its_defaults(capsys):
    problems = _command_problems(capsys)
    assert not problems, "documented command lines that do not match --help:\n" + "\n".join(
        problems
    )


def test_every_documented_benchmark_takes_its_options():
    problems = _benchmark_problems()
    assert not problems, "documented benchmark lines that do not run:\n" + "\n".join(problems)


def test_the_check_reads_a_usage_block(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(
        "```bash\nmlxkv serve [--port 8080] [--max-tokens N] \\\n"
        "            [--cache-dir-bytes 16GiB]   # comment --nope\n"
        "mlxkv chat [-m MODEL]\n           [--cache-entries 3]\n```\n"
        "and `mlxkv serve --fetch-images`\n"
    )
    assert _lines(doc) == [
        ("doc.md:2", "mlxkv serve [--port 8080] [--max-tokens N]  [--cache-dir-bytes 16GiB]"),
        ("doc.md:4", "mlxkv chat [-m MODEL] [--cache-entries 3]"),
        ("doc.md:7", "mlxkv serve --fetch-images"),
    ]


def test_the_check_reads_defaults_from_help(capsys):
    options = _option_defaults(_help("serve", capsys))
    assert options["--port"] == "8080" and options["--host"] == "127.0.0.1"
    assert _same_value("16GiB", options["--cache-dir-bytes"])
    assert not _same_value("4GiB", _option_defaults(_help("chat", capsys))["--cache-bytes"])
    assert "--no-cache-dir" in options and options["--fetch-images"] is not None


def _readme_runner_options() -> dict[str, str]:
    """The `name=default` pairs README lists for `Runner.load`'s keywords."""
    text = (ROOT / "README.md").read_text()
    listed = text.split("`Runner.load(path_or_repo", 1)[1].split("`Runner(loaded_model", 1)[0]
    listed = listed.split("as keywords (", 1)[1]
    return dict(re.findall(r"(\w+)=([^,`\s)]+)", listed))


def test_readme_lists_every_runner_option_with_its_default():
    listed = _readme_runner_options()
    fields = {field.name: field.default for field in dataclasses.fields(RunnerConfig)}
    assert sorted(listed) == sorted(fields)
    for name, default in fields.items():
        shown = listed[name].strip('"')
        if name.endswith("_bytes") and shown != "None":
            shown = parse_bytes(shown)
        assert shown in (str(default), default), f"README: {name}={listed[name]}, not {default!r}"


def test_server_doc_lists_every_field_of_the_cache_endpoint():
    # The endpoint returns `cache_info()`'s fields plus two, and each entry's but `isolated`
    # (tests/server/test_chat_page.py compares the endpoint with `cache_info()`).
    text = (ROOT / "docs" / "server.md").read_text()
    bullet = text.split("- `GET /v1/mlxkv/cache`", 1)[1].split("\n- ", 1)[0]
    report, entries = bullet.split("`entries` (each with", 1)
    named = set(re.findall(r"`([a-z_]+)`", report))
    fields = {field.name for field in dataclasses.fields(MemoryReport)}
    assert fields - {"entries"} | {"model", "max_context"} <= named
    entry_fields = {field.name for field in dataclasses.fields(EntryReport)} - {"isolated"}
    assert entry_fields <= set(re.findall(r"`([a-z_]+)`", entries))
