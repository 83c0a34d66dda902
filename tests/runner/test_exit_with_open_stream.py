"""A script that ends with a Runner's stream still open (held by a global) exits: the exit
hook that stops the engine (`engine._stop_all`) ends the stream first, as if it were closed;
it waited for the engine, which waited for the stream's next ask (found by review rs9b; it
pre-dated the kept threads)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.factories import tiny_model_dir

SCRIPT = """
import sys
from mlxkv import Runner
runner = Runner.load(sys.argv[1])
stream = iter(runner.stream("hi there", max_tokens=50))
next(stream)
"""


def test_a_script_ending_with_a_stream_open_exits(model_root):
    model = tiny_model_dir("llama", model_root)
    try:
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(model)], capture_output=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the process did not exit within 60 s of its script's end")
    assert done.returncode == 0, done.stderr.decode()[-2000:]
