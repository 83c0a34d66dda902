"""A child process forked beside a serving app, with Python run in the child before its exec
(`subprocess`'s `preexec_fn`, a forked worker): the child clears the state of the threads it
did not inherit, and their MLX stream releasers waited there, on the forking thread's stream,
for stream threads the child does not have: the child hung before its exec, and its parent
with it (review23c: a test that started servers under a low open-file limit hung)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import mlx.core as mx
import pytest

from mlxkv import Runner

from .conftest import serve

_CHILD_WAIT_S = 30.0


def _kill_children() -> None:
    """Kills this process's children: a child hung before its exec is then reaped as killed,
    instead of hanging its parent (and holding the test run's output open)."""
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        for pid in (task / "children").read_text().split():
            os.kill(int(pid), signal.SIGKILL)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds children in /proc")
def test_a_child_forked_beside_a_serving_app_starts(loaded_tiny):
    mx.eval(mx.arange(4) * 2)  # the forking thread has run MLX work, as a test's main thread has
    with serve(Runner(loaded_tiny("llama"), max_context=256)) as served:
        served.openai().chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        watchdog = threading.Timer(_CHILD_WAIT_S, _kill_children)
        watchdog.start()
        try:
            child = subprocess.run([sys.executable, "-c", "pass"], preexec_fn=int)
        finally:
            watchdog.cancel()
    assert child.returncode == 0, f"the child hung before its exec (killed: {child.returncode})"
