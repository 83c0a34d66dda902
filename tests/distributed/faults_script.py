"""Run by `test_rank_faults.py` under `mlx.launch -n 2 --backend ring`: rank 1 first calls
generate() (which must raise at once), then follows one request of rank 0 and freezes (or,
with `die`, exits; with `stall`, freezes inside its forward pass of rank 0's next request,
before the sharded layers' collectives, where rank 0 then waits); rank 0 must get a clear
error within MLXKV_RANK_TIMEOUT_S instead of hanging or an internal error. Each rank writes
what it saw to OUT_DIR/rank<r>.json.

    python tests/distributed/faults_script.py MODEL_DIR OUT_DIR [freeze|die|stall]
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import threading
import time
from pathlib import Path

from mlxkv import Runner
from mlxkv.errors import NotSupportedError, RanksOutOfStepError
from mlxkv.models.loading import load_model
from mlxkv.models.sharding import world


def report(out: Path, seen: dict) -> None:
    """Written whole under another name, then renamed: the test waits for the file to exist
    and must never read it half-written."""
    partial = out.with_suffix(".partial")
    partial.write_text(json.dumps(seen))
    os.replace(partial, out)


class Stalling:
    """A model whose forward passes never return once `stall` is set (a rank frozen inside
    one), before the sharded layers' collectives."""

    def __init__(self, model):
        self._model = model
        self.stall = False

    def __call__(self, *args, **kwargs):
        if self.stall:
            threading.Event().wait()
        return self._model(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._model, name)


def main(model_dir: str, out_dir: str, fault: str = "freeze") -> None:
    group = world()
    loaded = load_model(model_dir, group=group)
    model = Stalling(loaded.model)
    runner = Runner(dataclasses.replace(loaded, model=model), group=group, max_context=256)
    out = Path(out_dir, f"rank{runner.rank}.json")
    if runner.rank != 0:
        try:
            runner.generate("Hello", max_tokens=2)
            refused = None
        except NotSupportedError as error:
            refused = str(error)
        follow = runner.follow()
        next(follow)  # rank 0's first request, in step
        report(out, {"refused": refused})
        if fault == "die":
            os._exit(0)  # gone: its sockets close under rank 0
        if fault == "stall":
            model.stall = True
            with contextlib.suppress(RanksOutOfStepError):  # its own watchdog gives up
                next(follow)  # rank 0's next request: announced, then its forward pass
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
