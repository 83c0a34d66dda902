"""A garbage collection can run a Runner's finalizer (`store.close(False)`,
`engine.stop(False)`) on any thread, inside any allocation: also on a thread in
`BackgroundWriter.put` or `EngineThread._submit` that holds the writer's or the engine's own
lock, starting a run of that very writer or engine (a Runner dropped while its engine still
writes behind). Those finalizers took the same non-reentrant lock and hung that thread, and
with it every later collection in the process; they now take none, and the run being started
ends after its job instead of keeping its kept thread for good.

A collection is forced where `run_on_kept_thread` allocates, with a finalizer that closes or
stops that same writer or engine. Each case runs in a child process: a hung collection would
leave the test process unable to collect (later tests forcing one would fail)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent(
    """
    import gc, os, threading, weakref
    from mlxkv.runner.scheduling import engine as engine_module
    from mlxkv.runner.disk import writer as writer_module

    class Cycle:  # freed only by a garbage collection, as a Runner is
        def __init__(self):
            self.me = self

    def collected_while_started(module):
        started = module.run_on_kept_thread
        def start(loop, name):
            gc.collect()  # where the run's allocations may start one
            return started(loop, name)
        module.run_on_kept_thread = start

    done = []
    if CASE == "writer":
        owner = writer_module.BackgroundWriter(lambda job: None)
        finalize = lambda: (owner.close(False), done.append(True))
        collected_while_started(writer_module)
        job = writer_module.WriteJob(arrays={}, metadata={}, name="x", held_bytes=0)
        act = lambda: owner.put(job)
    else:
        owner = engine_module.EngineThread("test-engine-collected")
        finalize = lambda: (owner.stop(False), done.append(True))
        collected_while_started(engine_module)
        act = lambda: owner.call(lambda: None)
    dropped = Cycle()
    weakref.finalize(dropped, finalize)
    del dropped
    actor = threading.Thread(target=act, daemon=True)
    actor.start()
    actor.join(10.0)
    # the run started as the owner was finalized ends after its job (else its thread is lost)
    run = owner._run_on if CASE == "writer" else owner._run
    run_ended = run is None or run.ended.wait(10.0)
    print(f"hung: {actor.is_alive()}, finalized: {done}, run ended: {run_ended}", flush=True)
    os._exit(1 if actor.is_alive() or done != [True] or not run_ended else 0)
    """
)


@pytest.mark.parametrize("case", ["writer", "engine"])
def test_a_finalizer_run_by_a_collection_under_the_lock_it_takes_does_not_hang(case):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    script = f"CASE = {case!r}\n{_SCRIPT}"
    child = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, child.stdout + child.stderr[-2000:]
