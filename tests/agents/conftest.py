"""The coding agents people run (Claude Code, Codex CLI, installed from npm), headless against
`mlxkv serve` on 127.0.0.1: a tiny llama whose window holds their prompts (8-15k tokens with
its small vocabulary), greedy, with the access log read back for cached tokens."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from mlxkv import Runner
from mlxkv.models.loading import load_model
from mlxkv.testing.factory import build_model
from tests.server.conftest import serve

_AGENT_TIMEOUT_S = 300
WINDOW_TOKENS = 65536


def agent_cli(name: str) -> str:
    """The CLI's path; a skip where it is not installed, a failure under CI (which installs
    it from npm)."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed (npm install -g ...; .ci/run does)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def run_agent(args: list[str], env: dict[str, str], cwd) -> subprocess.CompletedProcess:
    """Runs an agent CLI to the end, failing with its output when it fails."""
    result = subprocess.run(
        args,
        env={**os.environ, **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=_AGENT_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, f"{args[0]} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="session")
def agent_model(tmp_path_factory):
    path = build_model(
        "llama",
        tmp_path_factory.mktemp("agent-model") / "llama",
        config_overrides={"max_position_embeddings": 2 * WINDOW_TOKENS},
    )
    return load_model(path)


@pytest.fixture
def agent_server(agent_model):
    with serve(Runner(agent_model, max_context=WINDOW_TOKENS)) as served:
        yield served
