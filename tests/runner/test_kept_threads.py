"""A garbage collection while a kept thread is being made can run a Runner's finalizer, which
waits for its disk writer's run to end (`BackgroundWriter.close`); that run ends by going idle,
under the kept threads' lock. The thread must not be made under that lock: the suite hung
there (a turn's write behind starting the writer's thread; the collection closing an earlier
Runner's writer)."""

from __future__ import annotations

import gc
import threading
import weakref

from mlxkv.platform import threads

_BOUND_S = 10.0  # a finalizer's wait that would never end fails here instead of hanging


class _Cycle:
    """Freed only by a garbage collection (it refers to itself), as a Runner is."""

    def __init__(self) -> None:
        self.me = self


def test_a_collection_while_a_kept_thread_is_made_lets_another_run_end(monkeypatch):
    monkeypatch.setattr(threads, "_idle", [])  # none idle: the next run makes a thread
    go = threading.Event()
    earlier = threads.run_on_kept_thread(lambda: go.wait(_BOUND_S), "test-earlier")
    waited: list[bool] = []

    def close_earlier() -> None:  # what a collected Runner's finalizer does to its writer
        go.set()
        waited.append(earlier.ended.wait(_BOUND_S))

    dropped = _Cycle()
    weakref.finalize(dropped, close_earlier)
    del dropped

    class CollectedWhileMade(threads._KeptThread):
        def __init__(self) -> None:
            gc.collect()  # where an allocation may start one
            super().__init__()

    monkeypatch.setattr(threads, "_KeptThread", CollectedWhileMade)
    later = threads.run_on_kept_thread(lambda: None, "test-later")
    try:
        assert waited == [True], "the earlier run could not end while the thread was made"
        assert later.ended.wait(_BOUND_S)
    finally:
        for kept in threads._idle:  # the threads this test made end with it
            kept.loops.put(None)
