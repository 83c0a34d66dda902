"""Conversations their clients deleted, counted, for the requests made before a deletion and
run after it (a server's request waiting its turn for the engine or a batch slot).

Owns `Deletions`. Does not own which entries a deletion frees (`pool.CachePool.drop_labelled`)
or when a request is made (`mlxkv.runner.runner.Runner.stream` reads `count` then).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Labels whose latest deletion is kept: a request made before one is missed only when it waits
# its turn through this many deletions of other labels.
MOST_LABELS = 1024


@dataclass
class Deletions:
    """The labels deleted: `count` so far, and `at[label]` the count at the latest deletion of
    each of the last `MOST_LABELS` labels (insertion order: the oldest first)."""

    count: int = 0
    at: dict[str, int] = field(default_factory=dict)

    def add(self, label: str) -> None:
        """Counts a deletion of `label` (its conversation's entries were just freed)."""
        self.count += 1
        self.at.pop(label, None)  # last in order: forgotten last
        self.at[label] = self.count
        if len(self.at) > MOST_LABELS:
            del self.at[next(iter(self.at))]

    def since(self, label: str | None, count: int) -> bool:
        """True when `label` was deleted after the deletions numbered `count` (a request made
        then, given `label`, belongs to a conversation deleted before it ran)."""
        return label is not None and self.at.get(label, -1) > count
