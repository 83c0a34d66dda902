"""The pause: what a request's step yields, in place of a token or a chunk, where the requests
interleaved with it may run first (between prefill chunks, while a shared prefix or prompts to
prefill together are on their way, while a freshly joined row waits for the batch's step).

Owns `PAUSE`, the one value that means it from the decode loops up to the engine thread, which
runs another job there; a serial caller, with nobody to let run, skips it.
"""

from __future__ import annotations

from typing import Final, final


@final
class Pause:
    """The type of `PAUSE` (one instance)."""

    _instance: Pause | None = None

    def __new__(cls) -> Pause:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "PAUSE"

    def __bool__(self) -> bool:
        return False


PAUSE: Final = Pause()
