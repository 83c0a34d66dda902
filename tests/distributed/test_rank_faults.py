"""A sharded Runner misused or with a rank that froze fails at once and says what to do,
instead of hanging (a follower calling generate() as mlx-lm's examples do; a frozen follower
that hung every request while /health said ok)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.factories import tiny_model_dir, wait_until

from .test_sharded import ROOT, ring

SCRIPT = Path(__file__).with_name("faults_script.py")


# Where rank 0 waits for rank 1, and so which bound fails it: its own collective's, or the
# watchdog of the step inside a forward pass.
_WAITED_IN = {
    "freeze": "the other ranks did not answer within 3 s",
    "die": "a collective with the other ranks failed",
    "stall": "one step of the sharded model (a prefill chunk or a decode step) ran past "
    "MLXKV_RANK_TIMEOUT_S=3 s",
}


@pytest.mark.parametrize("fault", list(_WAITED_IN))
def test_follower_generate_raises_and_a_lost_follower_fails_rank_0_in_bounded_time(
    fault, model_root, tmp_path
):
    model = tiny_model_dir("llama", model_root)
    command = [*ring(2), sys.executable, str(SCRIPT)]
    process = subprocess.Popen(
        [*command, str(model), str(tmp_path), fault],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env={**os.environ, "MLXKV_RANK_TIMEOUT_S": "3"},
        start_new_session=True,  # its own process group: both ranks are stopped below
    )
    leader, follower = tmp_path / "rank0.json", tmp_path / "rank1.json"
    try:
        wait_until(lambda: leader.exists() and follower.exists(), 120, "both ranks' reports")
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        output = process.communicate()[0].decode(errors="replace")
    refused = json.loads(follower.read_text())["refused"]
    assert refused and "ranks other than 0 call runner.follow()" in refused, output[-3000:]
    seen = json.loads(leader.read_text())
    assert seen["error"] and "restart every rank" in seen["error"], output[-3000:]
    assert _WAITED_IN[fault] in seen["error"]
    assert seen["waited_s"] < 60
    assert seen["again"] == seen["error"] == seen["health"]
