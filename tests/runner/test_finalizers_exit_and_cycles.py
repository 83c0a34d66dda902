"""What a Runner's lock-free finalizers (3e0224b: `engine.stop(False)`, `store.close(False)`,
which wait for nothing) leave to others, checked end to end (review rs11):

- a Runner dropped with writes still queued has them on disk after the process exits
  normally: the writer's exit hook (`writer._close_all`, run by `threads._end_idle` after the
  engines have stopped) finishes them. Reference: the same script closing its Runner;
- Runners with a disk tier made, used and dropped over and over, with collections forced at
  nearly every allocation (`gc.set_threshold(1)`) on several threads at once, neither hang
  (checked in a child process with a deadline) nor keep more kept threads as they go;
- a Runner stays usable after `close()` and after its engine's run ends and starts again
  (seeded sampling draws as before: a new run reseeds the thread's key, not a seeded one's).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from mlxkv import Runner
from tests.factories import tiny_model_dir

_EXIT_SCRIPT = textwrap.dedent(
    """
    import gc, sys, threading
    from mlxkv import Runner
    from mlxkv.runner.disk.store import DiskStore

    model, cache_dir, ending = sys.argv[1:]
    release = threading.Event()  # the writes wait until the script has ended
    write = DiskStore._run
    DiskStore._run = lambda store, job: (release.wait(), write(store, job))
    runner = Runner.load(model, cache_dir=cache_dir, max_context=2048)
    for i in range(3):
        runner.generate(f"conversation {i}: " + "tell me about caches " * 30, max_tokens=4)
    queued = len(runner._pool.store._writer.queued_names())
    print(queued, flush=True)
    if ending == "close":
        release.set()
        runner.close()
    else:  # dropped: its finalizer asks the writer to end, and waits for nothing
        del runner
        gc.collect()
        release.set()  # an exit hook may now write; the script ends at once
    """
)


def _files(root: Path) -> list[str]:
    return sorted(path.name for path in root.rglob("*") if path.is_file())


def _run_script(model: Path, cache_dir: Path, ending: str) -> int:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    args = [sys.executable, "-c", _EXIT_SCRIPT, str(model), str(cache_dir), ending]
    child = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    return int(child.stdout.split()[-1])


def test_writes_a_dropped_runner_left_are_on_disk_after_a_normal_exit(model_root, tmp_path):
    model = tiny_model_dir("llama", model_root)
    closed, dropped = tmp_path / "closed", tmp_path / "dropped"
    _run_script(model, closed, "close")
    queued_at_drop = _run_script(model, dropped, "drop")
    assert queued_at_drop > 0, "nothing was left to write when the Runner was dropped"
    assert _files(dropped) == _files(closed) != []


_STORM_SCRIPT = textwrap.dedent(
    """
    import gc, sys, threading
    from mlxkv import Runner
    from mlxkv.models.loading import load_model

    loaded = load_model(sys.argv[1])
    cache_dir, num_threads, rounds = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    errors = []

    def work(k):
        try:
            for i in range(rounds):
                runner = Runner(loaded, cache_dir=cache_dir, max_context=512)
                runner.generate(f"thread {k} round {i}: " + "hello there " * 40, max_tokens=3)
                if i % 2:
                    runner.close()
                del runner
        except Exception as error:
            errors.append(repr(error))

    gc.set_threshold(1)  # a collection at nearly every allocation, finalizers anywhere
    workers = [threading.Thread(target=work, args=(k,)) for k in range(num_threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    print(errors, flush=True)
    """
)


def test_runners_dropped_on_several_threads_amid_collections_never_hang(model_root, tmp_path):
    model = tiny_model_dir("llama", model_root)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    args = [sys.executable, "-c", _STORM_SCRIPT, str(model), str(tmp_path), "3", "8"]
    try:
        child = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail("a thread hung (or the exit did) within 300 s")
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split("\n")[-2] == "[]"
    assert _files(tmp_path), "nothing was written"


def test_load_use_drop_cycles_with_a_disk_tier_keep_the_threads_bounded(loaded_tiny, tmp_path):
    loaded = loaded_tiny("llama")
    counts = []
    for cycle in range(8):
        runner = Runner(loaded, cache_dir=tmp_path, max_context=512)
        runner.generate(f"cycle {cycle}: " + "hello there " * 40, max_tokens=3)
        del runner
        gc.collect()
        counts.append(threading.active_count())
    assert max(counts[2:]) <= counts[1] + 2, counts  # an engine and a writer still ending


def test_a_runner_is_usable_after_close_and_an_engine_restart_seeded_as_before(loaded_tiny):
    runner = Runner(loaded_tiny("llama"), max_context=512)
    options = {"max_tokens": 12, "temperature": 1.0, "seed": 5}
    want = runner.generate("seeded text please", **options).tokens
    runner.close()
    assert runner.generate("seeded text please", **options).tokens == want
    engine = runner._engine
    run = engine._run
    engine.stop()  # the run ends; the next job starts another (reseeding the thread's key)
    assert run.ended.is_set() and engine._run is None
    assert runner.generate("seeded text please", **options).tokens == want
    assert engine._run is not run
    unseeded = [runner.generate("seeded text please", max_tokens=12, temperature=1.0).tokens]
    engine.stop()
    unseeded.append(runner.generate("seeded text please", max_tokens=12, temperature=1.0).tokens)
    assert unseeded[0] != unseeded[1]  # a new run's key is drawn, not the seed's left behind
