"""Slots in the decode batch: how many batched streams of a Runner run at once.

Owns `Slots`, a counting semaphore whose waiters give up when their request is cancelled
(a client that leaves while waiting frees nothing and waits no more), and whose count says
whether a request runs alone (speculative decoding is kept for that case).
"""

from __future__ import annotations

import threading

# How often a waiter looks at its cancel flag (seconds): an Event cannot be waited on
# together with a Condition.
_CANCEL_POLL_S = 0.05


class Slots:
    """At most `limit` holders at once.

    Args:
        limit: the most holders (a Runner's `max_batch`).
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.taken = 0
        self._free = threading.Condition()

    def acquire(self, cancelled: threading.Event) -> bool:
        """Waits for a place; False (and no place) once `cancelled` is set first."""
        with self._free:
            while self.taken >= self.limit:
                if cancelled.is_set():
                    return False
                self._free.wait(_CANCEL_POLL_S)
            self.taken += 1
            return True

    def release(self) -> None:
        with self._free:
            self.taken -= 1
            self._free.notify()
