"""Run by `test_rank_faults.py` under `mlx.launch -n 2 --backend ring`: rank 1 first calls
generate() (which must raise at once), then follows one request of rank 0 and freezes (or,
with `die`, exits); rank 0 must get a clear error within MLXKV_RANK_TIMEOUT_S instead of
hanging or an internal error. Each rank writes what it saw to OUT_DIR/rank<r>.json.

    python tests/distributed/faults_script.py MODEL_DIR OUT_DIR [freeze|die]
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

from mlxkv import Runner
from mlxkv.errors import NotSupportedError, RanksOutOfStepError


def report(out: Path, seen: dict) -> None:
    """Written whole under another name, then renamed: the test waits for the file to exist
    and must never read it half-written."""
    partial = out.with_suffix(".partial")
    partial.write_text(json.dumps(seen))
    os.replace(partial, out)


def main(model_dir: str, out_dir: str, fault: str = "freeze") -> None:
    runner = Runner.load(model_dir, max_context=256)
    out = Path(out_dir, f"rank{runner.rank}.json")
    if runner.rank != 0:
        try:
            runner.generate("Hello", max_tokens=2)
            refused = None
        except NotSupportedError as error:
            refused = str(error)
        next(iter(runner.follow()))  # rank 0's first request, in step
        report(out, {"refused": refused})
        if fault == "die":
            os._exit(0)  # gone: its sockets close under rank 0
        threading.Event().wait()  # frozen: never answers rank 0 again
    runner.generate("Hello", max_tokens=4)
    start = time.monotonic()
    try:
        runner.generate("Hello again", max_tokens=4)
        error = None
    except RanksOutOfStepError as raised:
        error = str(raised)
    waited_s = time.monotonic() - start
    try:
        runner.generate("Once more", max_tokens=1)
        again = None
    except RanksOutOfStepError as raised:
        again = str(raised)
    report(out, {"error": error, "waited_s": waited_s, "again": again, "health": runner.health})
    os._exit(0)  # the collectives' thread still waits for rank 1, which never answers


if __name__ == "__main__":
    main(*sys.argv[1:4])
