"""Where the prompt cache's chats were cut to the window, for the request builder to cut the
next turn there again (`mlxkv.runner.context.choose_cut` prefers a cut the cache holds).

Owns `ChatCuts`: the first message kept by the cut of each entry in memory
(`CacheEntry.cut_start`) and of entries evicted to the disk tier (remembered here: the tier
keeps K/V, not messages), and how many leading tokens of a candidate cut the cache holds, in
memory or on disk. Does not own the cut (`context`) nor eviction (`pool`, which tells it).

Terms:
  cut start  the first message a chat cut to the window keeps after its system prompt.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from mlxkv.runner.prompt_cache.entry import CacheEntry, token_array
from mlxkv.runner.text.messages import Message

# Cut starts of entries evicted to disk kept per Runner: messages the client sends back anyway,
# so each costs a reference; the oldest conversations' cuts go first.
MOST_EVICTED_CUTS = 256


class ChatCuts:
    """The cuts a pool's entries hold, newest first, and how much of a candidate they hold.

    Without the evicted entries' cuts, a conversation cut to the window whose entry went to
    disk (more conversations than `cache_entries`) was cut afresh on its next turn, elsewhere
    than its blocks begin, and missed most of the window on every turn. Safe from any thread.
    """

    def __init__(self, pool):
        self._pool = pool
        self._evicted: deque[tuple[str | None, Message]] = deque(maxlen=MOST_EVICTED_CUTS)

    def evicted(self, entry: CacheEntry) -> None:
        """Remembers the cut of `entry`, which the pool just handed to its disk tier."""
        if entry.cut_start is not None:
            self._evicted.appendleft((entry.salt, entry.cut_start))

    def starts(self, salt: str | None = None) -> list[Message]:
        """The cut starts of `salt`'s entries: in memory (most recently used first), then
        evicted to disk (most recently evicted first)."""
        entries = reversed(self._pool.entries)  # most recently used first
        held = [e.cut_start for e in entries if e.cut_start is not None and e.salt == salt]
        return held + [start for owner, start in list(self._evicted) if owner == salt]

    def held_prefix(self, tokens: Sequence[int], salt: str | None = None) -> int:
        """The most leading tokens of `tokens` an entry of `salt` held at the end of its last
        request or a disk-tier chain of `salt` holds (the files indexed now: never waits)."""
        in_memory = self._pool.longest_prefix(tokens, salt=salt)
        store = self._pool.store
        if store is None:
            return in_memory
        on_disk = store.best(token_array(tokens), len(tokens), salt, rescan=False)[1]
        return max(in_memory, on_disk)
