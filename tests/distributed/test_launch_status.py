"""What `mlx.launch` reports when a rank fails, as docs/distributed.md says: the rank's code
in a `[WARN] Node with rank N exited with code X` line on stderr, and status 0 for the launch
(mlx 0.32's `_launch_with_io` keeps the ranks' codes to itself). No rank can change that:
a local rank's parent is the launcher, but killing it would leave the other ranks running,
and a remote rank's parent is ssh. Pinned so that the docs change when mlx does."""

from __future__ import annotations

import subprocess
import sys

from .test_sharded import ROOT, ring

RANK_1_FAILS = """
import sys
import mlx.core as mx
sys.exit(3 if mx.distributed.init().rank() == 1 else 0)
"""


def test_a_failed_rank_is_a_warning_and_the_launch_exits_0():
    command = [*ring(2), sys.executable, "-c", RANK_1_FAILS]
    ended = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert "Node with rank 1 exited with code 3" in ended.stderr, ended.stderr
    assert ended.returncode == 0
