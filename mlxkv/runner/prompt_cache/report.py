"""Memory reports: what the cache and the process hold, in bytes, and how to show them.

Owns: `MemoryReport` and `EntryReport` (bytes as ints), the log line shown from them, and
`MemoryLine`, which logs that line as each request ends (the line a Runner's `memory_line`
returns).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from mlxkv.config import format_bytes
from mlxkv.runner.disk.writer import PendingWrites
from mlxkv.runner.prompt_cache.holdings import Holdings
from mlxkv.runner.prompt_cache.pool import CachePool

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EntryReport:
    """One prompt-cache entry.

    Attributes:
        num_tokens: tokens it held at the end of its last request.
        used_bytes: bytes holding them.
        allocated_bytes: bytes allocated, unused slots included, plus its checkpoints.
        last_used: when a request last used it (seconds since the epoch).
        current: it is the entry of the running or last request.
        label: what it serves, as its last request's `cache_key` named it (None: unknown).
        draft_bytes: bytes of the draft model's cache for it (speculative decoding).
        isolated: made by requests with a `cache_salt` (shown only to its own salt's users).
    """

    num_tokens: int
    used_bytes: int
    allocated_bytes: int
    last_used: float
    current: bool
    label: str | None = None
    draft_bytes: int = 0
    isolated: bool = False


@dataclass(frozen=True)
class MemoryReport:
    """A snapshot of cache and device memory. Every `*_bytes` field is in bytes; token and
    byte totals are over all entries.

    Attributes:
        num_tokens: tokens whose K/V (or recurrent state) the entries hold.
        used_bytes: bytes holding those tokens (sum over layers and entries).
        allocated_bytes: bytes the entries have allocated, unused slots included.
        peak_bytes: MLX's peak memory since the last reset (per generation in the runner).
        active_bytes: memory MLX arrays hold right now.
        mlx_cache_bytes: memory MLX keeps for reuse (freed arrays not yet returned).
        checkpoint_bytes: snapshots of recurrent / sliding-window layers kept for rewinding.
        entries: each entry, least recently used first.
        max_entries: most entries kept in memory.
        budget_bytes: the entries' byte budget (None: no limit).
        held_bytes: what counts against the budget (allocated, checkpoints, the draft model's
            caches, pending writes, a vision model's encoder outputs).
        encoder_bytes: a vision model's encoder outputs kept by image digest (0: none kept,
            or a text model), part of `held_bytes`.
        disk_entries: blocks in the disk tier (0 without one).
        disk_bytes: their bytes and those of the reply records written beside them
            (`mlxkv.runner.disk.replies`): what counts against `disk_budget_bytes`.
        disk_budget_bytes: the disk tier's byte budget (None: no disk tier).
        disk_pending_writes: writes to the disk tier queued and not yet done (blocks and reply
            records; 0 without a disk tier): at 0, every turn that ended is on disk.
        disk_pending_bytes: the memory those writes keep alive (part of `held_bytes`).
    """

    num_tokens: int
    used_bytes: int
    allocated_bytes: int
    peak_bytes: int
    active_bytes: int
    mlx_cache_bytes: int
    checkpoint_bytes: int = 0
    entries: tuple[EntryReport, ...] = ()
    max_entries: int = 1
    budget_bytes: int | None = None
    held_bytes: int = 0
    encoder_bytes: int = 0
    disk_entries: int = 0
    disk_bytes: int = 0
    disk_budget_bytes: int | None = None
    disk_pending_writes: int = 0
    disk_pending_bytes: int = 0

    @classmethod
    def measure(cls, pool: CachePool, usage: Holdings | None = None) -> MemoryReport:
        """The report of `pool` now; `holdings` is what it holds when the caller has just read
        it (`CachePool.release` returns it), else it is read here (`CachePool.usage`)."""
        usage = pool.usage() if usage is None else usage
        current = pool.latest
        reports = tuple(
            EntryReport(
                num_tokens=h.footprint.num_tokens,
                used_bytes=h.footprint.used_bytes,
                allocated_bytes=h.footprint.allocated_bytes + h.footprint.checkpoint_bytes,
                last_used=h.entry.last_used,
                current=h.entry is current,
                label=h.entry.label,
                draft_bytes=h.draft_bytes,
                isolated=h.entry.salt is not None,
            )
            for h in usage.entries
        )
        store = pool.store
        pending = store.pending_writes if store else PendingWrites(num_jobs=0, nbytes=0)
        return cls(
            num_tokens=sum(r.num_tokens for r in reports),
            used_bytes=sum(r.used_bytes for r in reports),
            allocated_bytes=sum(h.footprint.allocated_bytes for h in usage.entries),
            peak_bytes=mx.get_peak_memory(),
            active_bytes=mx.get_active_memory(),
            mlx_cache_bytes=mx.get_cache_memory(),
            checkpoint_bytes=usage.checkpoint_bytes,
            entries=reports,
            max_entries=pool.max_entries,
            budget_bytes=pool.max_bytes,
            held_bytes=usage.held_bytes,
            encoder_bytes=0 if pool.encoder is None else pool.encoder.nbytes,
            disk_entries=store.num_entries if store else 0,
            disk_bytes=store.nbytes if store else 0,
            disk_budget_bytes=store.max_bytes if store else None,
            disk_pending_writes=pending.num_jobs,
            disk_pending_bytes=pending.nbytes,
        )

    def log_line(self) -> str:
        """The one line logged after each generation."""
        line = (
            f"kv cache: {self.num_tokens} tokens, {format_bytes(self.used_bytes)} in use, "
            f"{format_bytes(self.allocated_bytes)} allocated, peak {format_bytes(self.peak_bytes)}"
        )
        if self.checkpoint_bytes:
            line += f", checkpoints {format_bytes(self.checkpoint_bytes)}"
        if self.encoder_bytes:
            line += f", image encoder outputs {format_bytes(self.encoder_bytes)}"
        if self.max_entries > 1 or self.disk_budget_bytes is not None:
            budget = f" of {format_bytes(self.budget_bytes)}" if self.budget_bytes else ""
            line += f", {_entries(len(self.entries))} {format_bytes(self.held_bytes)}"
            line += budget
        if self.disk_budget_bytes is not None:
            line += f", disk {_entries(self.disk_entries)} {format_bytes(self.disk_bytes)}"
        return line


def _entries(n: int) -> str:
    return f"{n} {'entry' if n == 1 else 'entries'}"


class MemoryLine:
    """Logs the memory line (INFO, this module's logger) each time a request ends, and keeps
    the last one (`text`).

    Args:
        pool: the prompt cache reported on.
        ranks: for a model sharded over processes, the ranks' part of the line (what every
            rank holds), from the report; None otherwise.
    """

    def __init__(self, pool: CachePool, ranks: Callable[[MemoryReport], str] | None = None):
        self._pool = pool
        self._ranks = ranks
        self.text = ""

    def log(self, holdings: Holdings) -> None:
        """Logs the line for what the pool holds (`holdings`, just read at a release)."""
        report = MemoryReport.measure(self._pool, holdings)
        self.text = report.log_line() + ("" if self._ranks is None else self._ranks(report))
        logger.info("%s", self.text)
