"""What the prompt cache's entries hold, in bytes: the figures the pool's budget and the memory
report both read.

Owns `Holdings` and `holdings`: each entry's footprint and its draft cache's bytes (as its
request's end recorded them, `CacheEntry.record`; measured now for an entry in use), and their
totals, where a checkpoint snapshot that entries copied from one another share is counted
once; and `Sized`, what holds memory outside the entries. Does not own which entries are kept
or evicted (`pool`), nor how a report shows them (`report`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from mlxkv.cache.footprint import Footprint
from mlxkv.runner.prompt_cache.entry import CacheEntry


class Sized(Protocol):
    """Anything holding memory that counts against the pool's budget outside its entries
    (`CachePool.working`: a decode batch's K/V)."""

    @property
    def nbytes(self) -> int: ...


@dataclass(frozen=True)
class Holding:
    """One entry: its cache's footprint, and the bytes of its draft model's cache
    (speculative decoding; allocated and checkpoints, 0 without one)."""

    entry: CacheEntry
    footprint: Footprint
    draft_bytes: int


@dataclass(frozen=True)
class Holdings:
    """What some entries hold.

    Attributes:
        entries: each entry's holding, in the order given (the kept, then the unkept).
        checkpoint_bytes: the checkpoints of all of them, each shared snapshot once.
        held_bytes: what counts against the pool's budget: the kept entries' allocated K/V,
            their draft caches and their checkpoints (each shared snapshot once), plus what
            is held outside the entries.
    """

    entries: tuple[Holding, ...]
    checkpoint_bytes: int
    held_bytes: int


def holdings(
    kept: Sequence[CacheEntry], *, unkept: Sequence[CacheEntry] = (), outside_bytes: int = 0
) -> Holdings:
    """What `kept` (counted against the budget) and `unkept` (measured, not counted: the
    last request's entry when the pool no longer keeps it) hold, with `outside_bytes` held
    elsewhere."""
    measured = [_measure(e) for e in [*kept, *unkept]]
    counted = measured[: len(kept)]
    held = sum(h.footprint.allocated_bytes + h.draft_bytes for h in counted)
    return Holdings(
        tuple(measured),
        checkpoint_bytes=_snapshot_bytes(measured),
        held_bytes=held + _snapshot_bytes(counted) + outside_bytes,
    )


def _measure(entry: CacheEntry) -> Holding:
    """As `entry.record` measured it at its request's end, else (in use) now."""
    recorded = entry.recorded  # read once: the engine thread may reset it meanwhile
    if recorded is not None:
        footprint, draft = recorded
    else:
        footprint = entry.cache.footprint()
        draft = None if entry.draft_cache is None else entry.draft_cache.footprint()
    draft_bytes = 0 if draft is None else draft.allocated_bytes + draft.checkpoint_bytes
    return Holding(entry, footprint, draft_bytes)


def _snapshot_bytes(measured: list[Holding]) -> int:
    snapshots = {id(s): s for h in measured for s in h.footprint.snapshots}
    return sum(s.nbytes for s in snapshots.values())
