"""Stop strings on streamed text: emit what cannot start one, hold back what might.

Owns `StopStrings` and `partial_suffix_length` (also used to hold back a tool-call marker).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    """Cuts streamed text at the first stop string, holding back text that may start one."""

    def __init__(self, stops: Sequence[str]):
        self._stops = tuple(stops)
        self._held = ""
        self.matched: str | None = None  # the stop string found, once one is

    def push(self, segment: str) -> tuple[str, bool]:
        """Adds a text segment; returns (text safe to emit now, whether a stop string ended it)."""
        text = self._held + segment
        found = [(i, s) for s in self._stops if (i := text.find(s)) >= 0]
        if found:
            self._held = ""
            start, self.matched = min(found)
            return text[:start], True
        hold = partial_suffix_length(text, self._stops)
        self._held = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], False

    def flush(self) -> str:
        """Text held back at the end of generation (it did not become a stop string)."""
        text, self._held = self._held, ""
        return text


def partial_suffix_length(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of `text` that is a proper beginning of one of `markers`:
    what must be held back because the next text may complete a marker."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest
