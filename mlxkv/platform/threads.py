"""MLX streams of threads other than the main one.

MLX gives each thread its own default stream. When a thread that ran MLX work ends, the C++
teardown of its streams can race the process's own exit and abort it ("terminate called without
an active exception", exit 134). Destroying them on that thread, when its Python state is
cleared (before `Thread.join` returns), removes the race. Used by the runner's request threads
and the disk tier's writer thread.
"""

from __future__ import annotations

import threading

import mlx.core as mx

_thread_local = threading.local()


class _StreamReleaser:
    """Lives in one thread's `threading.local`; freed on that thread when the thread ends."""

    def __del__(self) -> None:
        mx.synchronize()
        mx.clear_streams()


def release_streams_at_thread_exit() -> None:
    """Arranges for the calling thread's MLX streams to be destroyed on that thread when it
    ends (no-op on the main thread, whose streams live as long as the process)."""
    if threading.current_thread() is threading.main_thread():
        return
    if not hasattr(_thread_local, "releaser"):
        _thread_local.releaser = _StreamReleaser()
