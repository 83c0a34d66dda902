"""The command line and the examples, run as a user would (subprocesses, default model)."""

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(args, converted_cache, stdin=None, timeout=240):
    return subprocess.run(
        [sys.executable, *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def test_chat_through_a_pipe_reuses_the_cache(converted_cache):
    questions = "What is the capital of France?\nWhat river flows through it?\nAnd Italy?\n"
    result = _run(
        ["-m", "mlxkv.cli", "chat", "--verbose", "--max-tokens", "24"], converted_cache, questions
    )
    assert result.returncode == 0, result.stderr
    cached = [int(n) for n in re.findall(r"cached (\d+) \|", result.stderr)]
    assert len(cached) == 3, result.stderr
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > 0
    assert "Paris" in result.stdout


def test_generate_prints_the_answer_and_stats(converted_cache):
    result = _run(
        ["-m", "mlxkv.cli", "generate", "-p", "What is the capital of France?", "--verbose"],
        converted_cache,
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "kv cache:" in result.stderr and "ttft" in result.stderr
    # Both streams to one terminal: the memory line has a line of its own, after the answer.
    args = ["-m", "mlxkv.cli", "generate", "-p", "Hi", "--verbose", "--max-tokens", "8"]
    merged = subprocess.run(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=240,
        cwd=ROOT,
    ).stdout
    memory_lines = [line for line in merged.splitlines() if "kv cache:" in line]
    assert memory_lines and all(line.startswith("[kv cache:") for line in memory_lines), merged


def test_speculative_options_report_acceptance_and_refuse_a_missing_draft_model(converted_cache):
    prompt = "Repeat exactly: the cat sat on the mat, the cat sat on the mat."
    args = ["-m", "mlxkv.cli", "generate", "-p", prompt, "--verbose", "--max-tokens", "24"]
    result = _run([*args, "--speculative", "ngram"], converted_cache)
    assert result.returncode == 0, result.stderr
    assert re.search(r"drafted \d+, accepted \d+ \(\d+%\)", result.stderr), result.stderr
    result = _run([*args, "--speculative", "draft"], converted_cache)
    assert result.returncode == 2
    assert "needs a draft model" in result.stderr and "Traceback" not in result.stderr


def test_bad_model_is_a_one_line_error(converted_cache):
    result = _run(["-m", "mlxkv.cli", "generate", "-p", "hi", "-m", "/no/such"], converted_cache)
    assert result.returncode == 2
    assert result.stderr.startswith("mlxkv: error:") and "Traceback" not in result.stderr


@pytest.mark.parametrize("example", ["chat.py", "stream.py", "memory.py"])
def test_example_runs(converted_cache, example):
    result = _run([f"examples/{example}"], converted_cache)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def _run_bytes(args, stdin=None):
    return subprocess.run(
        [sys.executable, "-m", "mlxkv.cli", *args],
        input=stdin,
        capture_output=True,
        timeout=240,
        cwd=ROOT,
    )


def _bash(command: str):
    """`mlxkv` (as `{mlxkv}` in command) run by bash, for redirections and pipes."""
    full = command.format(mlxkv=f"{sys.executable} -m mlxkv.cli")
    return subprocess.run(
        full, shell=True, executable="/bin/bash", capture_output=True, timeout=240, cwd=ROOT
    )


def test_closed_stdin_and_non_utf8_argument(converted_cache):
    result = _bash("{mlxkv} generate --max-tokens 8 -p $'caf\\xe9 France?' 0<&-")
    assert result.returncode == 0, result.stderr.decode(errors="replace")[-1500:]
    assert b"Traceback" not in result.stderr and result.stdout.strip()


def test_output_into_a_closed_pipe_exits_quietly(converted_cache):
    result = _bash(
        "{mlxkv} generate --max-tokens 40 -p 'Count to ten.' | head -c 3; exit ${{PIPESTATUS[0]}}"
    )
    assert result.returncode == 141, result.stderr.decode(errors="replace")[-1500:]
    assert b"Traceback" not in result.stderr and b"Exception" not in result.stderr


def test_chat_commands_never_reach_the_model_and_bad_bytes_are_replaced(converted_cache):
    result = _run_bytes(["chat", "--max-tokens", "6", "-v"], stdin=b"/foo\n/help\n\xff\xfe hi\n")
    stderr = result.stderr.decode()
    assert result.returncode == 0, stderr[-1500:]
    assert "unknown command /foo" in stderr and "/reset" in stderr
    assert len(re.findall(r"cached (\d+) \|", stderr)) == 1  # one model turn: the text line


def test_version_and_defaults_in_help():
    version = _run_bytes(["--version"])
    assert version.returncode == 0 and version.stdout.startswith(b"mlxkv ")
    help_text = _run_bytes(["generate", "--help"]).stdout.decode()
    assert "(default: 256)" in help_text and "(default: 0.0)" in help_text


def _readme_python(section: str) -> str:
    """The first ```python block under README's `## {section}` heading."""
    text = (ROOT / "README.md").read_text().split(f"## {section}\n", 1)[1]
    return text.split("```python\n", 1)[1].split("```", 1)[0]


def test_readme_python_api_snippet_runs_and_its_second_turn_hits(converted_cache):
    # As a reader copies it: the snippet alone, in a fresh process, on the default model.
    result = _run(["-c", _readme_python("Python API")], converted_cache)
    assert result.returncode == 0, result.stderr[-1500:]
    cached = [int(n) for n in re.findall(r": cached (\d+) of \d+ prompt tokens", result.stdout)]
    assert len(cached) == 2 and cached[0] == 0 and cached[1] > 0, result.stdout
    assert "MemoryReport(num_tokens=" in result.stdout


def test_sigterm_mid_conversion_leaves_no_partial_directory(tmp_path):
    """`kill` (SIGTERM: systemd, `docker stop`, `timeout`) during a GGUF conversion ended the
    process without its cleanups: a 257 MB `.out.partial-*` directory stayed beside the output
    (and in the conversion cache, on a first `generate`/`serve` of a .gguf), never removed.
    SIGTERM now unwinds as Ctrl-C does, and the process still dies by SIGTERM."""
    from mlxkv.models.sources import default_model_path

    out = tmp_path / "out"
    command = [sys.executable, "-m", "mlxkv.cli", "convert", default_model_path(), str(out)]
    with subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True) as process:
        deadline = time.monotonic() + 120
        while not any(p.name.startswith(".out.partial-") for p in tmp_path.iterdir()):
            assert process.poll() is None, process.stderr.read()
            assert time.monotonic() < deadline, "the conversion did not start writing"
            threading.Event().wait(0.01)
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    assert process.returncode == -signal.SIGTERM
    assert [p.name for p in tmp_path.iterdir()] == []
