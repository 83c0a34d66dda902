"""The open-file limit. `import mlxkv` keeps it (mlx-lm, imported with it, set (2048, 4096):
a higher hard limit was capped for good, and under a hard limit below 4096 the import failed
with a traceback: ml-explore/mlx-lm#1589). `mlxkv serve` raises its soft limit to what its
connections may need (a burst of about 2,100 connections reached 2,048), and where the hard
limit is lower it says so, with the fix."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from mlxkv.platform import open_files
from mlxkv.platform.open_files import OPEN_FILES_WANTED
from tests.factories import tiny_model_dir
from tests.processes import ready_url

ROOT = Path(__file__).resolve().parents[2]
_TIMEOUT_S = 120
_HARD = resource.getrlimit(resource.RLIMIT_NOFILE)[1]


def _limited(soft: int, hard: int, *argv: str) -> list[str]:
    """A command that runs Python with `argv` under the open-file limit (`soft`, `hard`): set
    by a first Python that then execs it (a `preexec_fn` runs Python in a fork of this
    process, which holds MLX threads)."""
    setting = (
        "import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, "
        f"({soft}, {hard})); os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
    )
    return [sys.executable, "-c", setting, *argv]


def _limits_after_import(soft: int, hard: int) -> tuple[int, int]:
    shown = subprocess.run(
        _limited(soft, hard, "-c",
                 "import resource, mlxkv; print(*resource.getrlimit(resource.RLIMIT_NOFILE))"),
        capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=_TIMEOUT_S,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    soft_after, hard_after = shown.stdout.split()
    return int(soft_after), int(hard_after)


def test_importing_mlxkv_keeps_the_limit():
    assert _limits_after_import(1024, 1024) == (1024, 1024)  # was a ValueError
    if _HARD == resource.RLIM_INFINITY or _HARD > 4096:
        assert _limits_after_import(256, _HARD)[1] == _HARD  # was capped at 4096


def _serve(model: str, soft: int, hard: int) -> tuple[int, str]:
    """The soft limit of a server started under (`soft`, `hard`), and its stderr."""
    process = subprocess.Popen(
        _limited(soft, hard, "-m", "mlxkv.cli", "serve", "-m", model, "--port", "0",
                 "--no-cache-dir", "--no-warmup"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    try:
        ready_url(process, _TIMEOUT_S)
        limits = Path(f"/proc/{process.pid}/limits").read_text().splitlines()
        (line,) = [line for line in limits if line.startswith("Max open files")]
        allowed = int(line.split()[3])
    finally:
        process.terminate()
        stderr = process.communicate(timeout=_TIMEOUT_S)[1]
    return allowed, stderr


@pytest.mark.skipif(not Path("/proc/self/limits").exists(), reason="reads /proc")
@pytest.mark.skipif(
    _HARD != resource.RLIM_INFINITY and _HARD < OPEN_FILES_WANTED,
    reason=f"the hard limit here is under {OPEN_FILES_WANTED}",
)
def test_a_low_soft_limit_is_raised(model_root):
    allowed, stderr = _serve(str(tiny_model_dir("llama", model_root)), 256, _HARD)
    assert allowed == OPEN_FILES_WANTED
    assert "open files" not in stderr, stderr


@pytest.mark.skipif(not Path("/proc/self/limits").exists(), reason="reads /proc")
def test_a_low_hard_limit_is_said_with_the_fix(model_root):
    allowed, stderr = _serve(str(tiny_model_dir("llama", model_root)), 200, 300)
    assert allowed == 300
    assert "300 open files allowed" in stderr and "ulimit -Hn 448" in stderr, stderr


def test_a_limit_the_system_refuses_falls_back_to_what_macos_allows(monkeypatch):
    """macOS refuses a soft limit over 10,240 (EINVAL), even under an unlimited hard limit: a
    server whose connections asked for more kept 256 (review23c)."""
    set_to = []

    def setrlimit(which, limits):
        if limits[0] > OPEN_FILES_WANTED:
            raise ValueError("current limit exceeds maximum limit")
        set_to.append(limits)

    monkeypatch.setattr(open_files, "_SETRLIMIT", setrlimit)
    unlimited = (256, resource.RLIM_INFINITY)
    monkeypatch.setattr(resource, "getrlimit", lambda which: unlimited)
    assert open_files.raise_open_files(20_000) == OPEN_FILES_WANTED
    assert set_to == [(OPEN_FILES_WANTED, resource.RLIM_INFINITY)]


def test_a_refused_limit_is_never_raised_past_what_was_asked(monkeypatch):
    """mlx-lm's import asks for 2,048: refused, it is not raised to 10,240 instead."""
    set_to = []

    def setrlimit(which, limits):
        set_to.append(limits)
        raise ValueError("refused")

    monkeypatch.setattr(open_files, "_SETRLIMIT", setrlimit)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (256, resource.RLIM_INFINITY))
    assert open_files.raise_open_files(2_048) == 256
    assert set_to == [(2_048, resource.RLIM_INFINITY)]
