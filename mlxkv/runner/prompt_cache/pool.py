"""CachePool: the prompt cache's entries, matched by longest common prefix, under a count and
a byte budget, with an optional disk tier.

Owns: for each request, which entry to generate into, how much of it to reuse and where its
fill checkpoints; evicting entries after a request; handing each finished turn's entry to the
disk tier (written behind, in the background) and evicted ones too, and loading them back.
Does not own the file format (`store`), how tokens match the entries (`matching`) or any
model call.

Terms:
  entry        a ModelCache and the token ids it holds (generated into in place; `entry`);
  reply start  where the model's reply began in an entry's last request: tokens before it came
               from the client, tokens after it are the reply the client renders back;
  superseded   an entry whose tokens are a strict prefix of another entry's.

For a request's tokens T, r is the longest prefix of T an entry can return to exactly, at
most len(T) - 1 (`matching`). The entries work as a prefix tree whose nodes are the entries'
divergence points: one shared prefix is never held twice by entries that extend each other.
Then:
  - r == 0: a new, empty entry (a miss);
  - r == the entry's length: generate into it in place (nothing copied);
  - the entry goes on past r after its reply start (a reply rendered back differently, or
    regenerated: the same conversation): trim it to r in place;
  - before it (another conversation sharing a system prompt, an edited message): a new entry
    with a copy of the first r tokens' K/V; the entry stays for the conversation that still
    needs it (evicted to disk after the request if one entry is allowed). With one entry
    allowed and no disk tier it is trimmed in place instead (today's behaviour).
  - an entry in use is copied from, never trimmed; one copied as far as its whole prompt (the
    same conversation, a reply after it: the chat page's Stop then send) is dropped when its
    request ends, as if trimmed in place then, so the conversation's K/V are held once. Two
    requests with one prompt at once (a copy of less than it) keep both: both replies go back.
  - a disk file serving a longer prefix than any entry is loaded when reading it is expected
    to be faster than prefilling the difference (both rates measured as they run).

Requests may run interleaved (decoded in one batch): each holds its entry from `fetch_nearest`
to `release`. An entry in use is never trimmed, extended or evicted by another request; one
that shares a prefix with it gets a copy of that prefix, matched against the token ids its
cache holds at that moment (its request may have shifted it), so such a copy is exact. One
whose prompt shares more with a prompt still being fed waits for it (`awaits_prefix`).

Invariants:
  - `fetch_nearest` returns at least one token still to feed (a `PrefixHit`: generation needs
    logits, which only come from feeding at least one token);
  - after `release`, at most `max_entries` entries, and the bytes they hold (K/V allocated,
    checkpoints; plus entries still being written to disk and `working`'s) are at most
    `max_bytes`, unless entries in use alone are over (they cannot be evicted); the write the
    release queues after that eviction is over it until written (about a second).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from mlxkv.cache.model_cache import ModelCache
from mlxkv.runner.disk.snapshots import boundaries
from mlxkv.runner.disk.store import DiskStore
from mlxkv.runner.prompt_cache.cuts import ChatCuts
from mlxkv.runner.prompt_cache.deletions import Deletions
from mlxkv.runner.prompt_cache.entry import CacheEntry, token_array
from mlxkv.runner.prompt_cache.fit import fit_to_budget
from mlxkv.runner.prompt_cache.holdings import Holdings, Sized, holdings
from mlxkv.runner.prompt_cache.matching import (
    awaits_prefix,
    longest_prefix,
    nearest,
    superseded,
)
from mlxkv.runner.prompt_cache.reuse import load_nearest
from mlxkv.runner.text.messages import Message

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefixHit:
    """What a request reuses and what it still has to feed.

    Attributes:
        entry: the entry the request generates into, claimed by it until `CachePool.release`;
            its cache already trimmed to `num_cached` tokens.
        num_cached: tokens of the request whose K/V are reused.
        remaining: the request's tokens after those (never empty).
        checkpoints: where feeding `remaining` checkpoints the layers that cannot trim back
            (`ModelCache.checkpoint`), in tokens into it, ascending; empty when all can.
        disk_snapshots: where a chunk of it ends so that the cache snapshots them for the disk
            tier alone (block boundaries, `disk.snapshots`), the same way.
    """

    entry: CacheEntry
    num_cached: int
    remaining: list[int]
    checkpoints: tuple[int, ...] = ()
    disk_snapshots: tuple[int, ...] = ()


class CachePool:
    """The prompt cache: entries matched by longest common prefix.

    Args:
        make_entry: builds an empty ModelCache for the model.
        max_entries: most entries held in memory (1: one entry, trimmed in place).
        max_bytes: most bytes the entries may hold after a request; None for no limit.
        store: the disk tier for evicted entries; None for none.
    """

    def __init__(
        self,
        make_entry: Callable[[], ModelCache],
        *,
        max_entries: int = 1,
        max_bytes: int | None = None,
        store: DiskStore | None = None,
    ):
        self._make_entry = make_entry
        # whether every entry's layers (all from `make_entry`) need checkpoints, read once
        self._checkpointed = make_entry().needs_checkpoints
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.store = store
        self._entries: list[CacheEntry] = []
        # The entries of requests running now, each with the prompt its request feeds.
        self._in_use: dict[CacheEntry, np.ndarray] = {}
        # The entry claimed last: shown as current, and kept (by its longest prefix that fits)
        # rather than dropped when it alone is over the budget.
        self.latest: CacheEntry | None = None
        self.prefill_tokens_per_s: float | None = None  # set by the runner as it measures
        # What running requests hold outside the entries (a decode batch's K/V), if anything.
        self.working: Sized | None = None
        # A vision model's encoder outputs by image digest (`EncoderCache`): counted in the
        # budget like `working` (the entries make room for it), bounded by its own share.
        self.encoder: Sized | None = None
        self.deletions = Deletions()  # labels deleted (`drop_labelled`), counted
        self.cuts = ChatCuts(self)  # where its chats were cut, for the next turns

    @property
    def entries(self) -> list[CacheEntry]:
        """The entries, least recently used first (a copy of the list)."""
        return sorted(self._entries, key=lambda e: e.last_used)

    def fetch_nearest(
        self,
        tokens: Sequence[int],
        *,
        reply_start: int | None = None,
        salt: str | None = None,
        keep: int = 0,
        label: str | None = None,
        evict_first: bool = False,
        cut_start: Message | None = None,
        drops_before: int | None = None,
    ) -> PrefixHit:
        """Claims the entry for `tokens` (reused, copied or new), ready for the rest of them.

        Args:
            tokens: the request's prompt.
            reply_start: where the reply will begin (the prompt's length less the chat
                template's generation prompt); None for the prompt's end.
            salt: the isolation domain (a digest of a request's `cache_salt`); only its
                entries and files match.
            keep: the leading tokens every cut of the prompt keeps (its system prompt).
            label: what the entry serves (a conversation id a client sent), if known.
            evict_first: a later choice of a request: its entry is a copy (never the one it
                matched, trimmed), evicted first (`CacheEntry.evict_first`).
            cut_start: the first message kept when the chat was cut to the window, if cut.
            drops_before: `deletions.count` when the request was made (None: now); its entry
                is freed when it ends if `label` was deleted since, as one in use then is.

        The entry (`PrefixHit.entry`) is in use until `release(entry)`: other requests
        meanwhile copy from it.

        Raises:
            ValueError: tokens is empty.
        """
        if not tokens:
            raise ValueError("cannot match an empty token sequence")
        query, limit = token_array(tokens), len(tokens) - 1
        entries, in_use, checkpointed = self._entries, self._in_use, self._checkpointed
        found = nearest(entries, in_use, query, limit=limit, salt=salt, checkpointed=checkpointed)
        found.log_unreachable()
        entry, reuse = found.entry, found.reuse
        if self.store is not None:
            entry, reuse = self._maybe_load(query, limit, entry, reuse, salt)
        entry, how = self._prepare(entry, reuse, trim=not evict_first)
        _log_lookup(len(tokens), reuse, how)
        entry.salt, entry.recorded = salt, None  # measured as it is fed until released
        entry.tokens = query[:reuse].copy()  # held, in order, for requests meanwhile
        reply_start = len(tokens) if reply_start is None else reply_start
        entry.reply_start = min(reply_start, limit)
        entry.last_used, entry.evict_first = time.time(), evict_first and how.startswith("copied")
        entry.cut_start = cut_start
        entry.label, entry.keyed_by = entry.label if label is None else label, label
        self.latest = entry
        self._in_use[entry] = query
        if salt is None and drops_before is not None and self.deletions.since(label, drops_before):
            self._drop(entry, write=False)  # its conversation deleted while it waited its turn
        points = self._checkpoints(len(tokens), reuse, reply_start, keep)
        every = None if self.store is None else self.store.snapshot_every_tokens
        snaps = tuple(p - reuse for p in boundaries(reuse, len(tokens), every))
        return PrefixHit(entry, reuse, list(tokens[reuse:]), points, snaps)

    def _checkpoints(self, total: int, reuse: int, reply: int, keep: int) -> tuple[int, ...]:
        """Where a request feeding tokens `reuse`..`total` checkpoints layers that cannot trim
        back, in tokens after `reuse`: where the reply starts (`reply`: the conversation's next
        turn goes back there when it renders the reply differently) and, with several entries,
        where `keep` ends (another conversation sharing the system prompt copies it)."""
        if not self._checkpointed:
            return ()
        ends = {reply, keep} if self.max_entries > 1 else {reply}
        return tuple(sorted(p - reuse for p in ends if reuse < p < total))

    def awaits_prefix(self, tokens: Sequence[int], salt: str | None = None) -> bool:
        """True when a request running now is still feeding its prompt, and that prompt
        shares more of `tokens` than any entry holds yet: a request that waits until it is
        fed copies those tokens instead of feeding them a second time (agents that send
        several requests at once with one long system prompt)."""
        if not self._in_use:  # nothing is being fed (the ids not even converted)
            return False
        query = token_array(tokens)
        entries, in_use, checkpointed = self._entries, self._in_use, self._checkpointed
        return awaits_prefix(entries, in_use, query, salt=salt, checkpointed=checkpointed)

    def _prepare(self, entry: CacheEntry | None, reuse: int, trim: bool) -> tuple[CacheEntry, str]:
        """The entry a request reusing `reuse` tokens of `entry` generates into (`entry`
        itself, trimmed if `trim`, or a new one with a copy of that prefix), and how."""
        if reuse == 0:
            return self._add(self._make_entry()), "new entry"
        if entry in self._in_use:  # another request is generating into it
            copy = self._add(entry.cache.copy_prefix(reuse), keep=entry)
            # Its conversation goes on in the copy when the copy took all of its prompt (the
            # new one renders a reply after it); a copy that stops inside it is a request
            # with the same prompt at once, and both replies go back to their clients.
            if reuse >= self._in_use[entry].size:
                entry.went_on_in = copy
            return copy, "copied prefix of an entry in use"
        if reuse >= entry.num_tokens:  # not in use: its tokens are its cache's
            return entry, "extended in place"
        # one entry and nowhere to keep the other conversation: trim (today's behaviour)
        alone = self.max_entries == 1 and self.store is None
        if alone or (trim and reuse >= entry.reply_start):
            trimmed = entry.cache.rewind_to(reuse, shrink=True)
            logger.debug("prefix cache trim tokens=%d", trimmed)
            return entry, "trimmed in place"
        return self._add(entry.cache.copy_prefix(reuse), keep=entry), "copied prefix"

    def _maybe_load(
        self, query: np.ndarray, limit: int, entry: CacheEntry | None, reuse: int, salt: str | None
    ) -> tuple[CacheEntry | None, int]:
        """The entry and reuse after loading what pays of the chain on disk that serves the
        longest prefix of `query` (`reuse.load_nearest`), added as an idle entry."""
        loaded = load_nearest(
            self.store,
            query,
            limit=limit,
            reuse=reuse,
            salt=salt,
            make_entry=self._make_entry,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
        )
        if loaded is None:
            return entry, reuse
        cache, restored = loaded
        logger.info("disk cache: loaded an entry of %d tokens", cache.num_tokens)
        if cache.gate is not None:  # still being checked: used in place (a copy would wait)
            cache.rewind_to(restored)
        loaded_entry = self._add(cache)
        loaded_entry.record()  # idle until a request takes it (it may only be copied from)
        loaded_entry.reply_start = cache.num_tokens  # a reply rendered back: the same chat
        return loaded_entry, restored

    def _add(self, cache: ModelCache, keep: CacheEntry | None = None) -> CacheEntry:
        """Adds an entry for `cache`, first evicting one if the pool is full (never `keep`,
        the entry the new one is copied from)."""
        self._evict(self.max_entries - 1, None, keep=keep)
        cache.snapshot_every_tokens = self.store and self.store.snapshot_every_tokens
        entry = CacheEntry(cache)
        self._entries.append(entry)
        return entry

    def release(self, entry: CacheEntry) -> Holdings:
        """Ends a request on `entry` (`PrefixHit.entry`): records what it holds, evicts to the
        budget, and writes it behind to the disk tier. The entry is evicted last (only when it
        alone is over the budget); entries still in use are not evicted.

        Returns:
            What the pool holds then (`holdings`): the request's memory line reports it.
        """
        self._in_use.pop(entry, None)
        went_on, entry.went_on_in = entry.went_on_in, None
        if entry.record() == 0 and entry in self._entries:
            self._entries.remove(entry)
        elif went_on in self._entries and entry in self._entries:
            # free, it would have been trimmed in place: its prefix is not held twice
            self._drop(entry, write=False)
        if self.store is not None and entry in self._entries:
            self._write(entry)  # first: the eviction counts its pending copies in the budget
        # fitted, not dropped, when it alone is over: it is the latest only when no request
        # started after it (a decode batch releases out of order)
        self._evict(self.max_entries, self.max_bytes, fit=entry)
        return self.usage()

    def evict(self, *, max_bytes: int | None = None, max_entries: int | None = None) -> int:
        """Evicts entries until at most `max_entries` remain and they hold at most `max_bytes`
        bytes: superseded entries first, then the least recently used. Evicted entries go to
        the disk tier when there is one (written in the background: never waited for here).
        The latest entry is never evicted for writes still in flight (they end by
        themselves); when it alone is over `max_bytes` it keeps its longest prefix that fits.

        Returns:
            The number of entries evicted.
        """
        return self._evict(max_entries, max_bytes)

    def _evict(
        self,
        max_entries: int | None,
        max_bytes: int | None,
        keep: CacheEntry | None = None,
        fit: CacheEntry | None = None,
    ) -> int:
        """`evict`, never taking `keep`, and keeping the longest prefix that fits of `fit`
        (default: the latest entry) when it is the last one left to evict."""
        fit = self.latest if fit is None else fit
        evicted = 0
        while True:
            over_count = max_entries is not None and len(self._entries) > max_entries
            over_bytes = max_bytes is not None and self.nbytes > max_bytes
            candidates = [e for e in self._entries if e is not keep and e not in self._in_use]
            if not (over_count or over_bytes) or not candidates:
                return evicted
            victim = min(
                candidates,
                key=lambda e: (not superseded(e, self._entries), not e.evict_first, e.last_used),
            )
            if victim is fit and len(candidates) == 1 and not over_count:
                room = max(0, max_bytes - self._in_use_bytes())
                if not fit_to_budget(victim, room, self.store):
                    self._drop(victim, write=False, evicted=True)  # written, or broken
                    evicted += 1
                return evicted
            self._drop(victim, evicted=True)
            evicted += 1

    def _drop(self, entry: CacheEntry, *, write: bool = True, evicted: bool = False) -> None:
        """Drops `entry`; `evicted`: for room (written to the disk tier here, or by
        `fit_to_budget` before), so its chat's cut is remembered, unlike a deleted one's."""
        self._entries.remove(entry)
        if entry is self.latest:
            self.latest = None
        held = holdings([entry]).held_bytes
        logger.debug("prefix cache evict tokens=%d bytes=%d", entry.num_tokens, held)
        if evicted and self.store is not None:
            self.cuts.evicted(entry)
        if write and self.store is not None:
            self.store.write(entry.cache, salt=entry.salt, reply_start=entry.reply_start)

    def _write(self, entry: CacheEntry, *, wait: bool = False) -> None:
        """Writes `entry` to the disk tier; its disk snapshots go with the write (an idle
        entry's bytes recorded again without them: the writer's pending bytes count them)."""
        snapshots = entry.cache.footprint().snapshots
        self.store.write(entry.cache, wait=wait, salt=entry.salt, reply_start=entry.reply_start)
        if entry.recorded is not None and entry.cache.footprint().snapshots != snapshots:
            entry.record()

    def _in_use_bytes(self) -> int:
        """Bytes only the requests running now can give back (their entries, the batch)."""
        return holdings(list(self._in_use), outside_bytes=self._working_bytes()).held_bytes

    def _working_bytes(self) -> int:
        held = [self.working, self.encoder]
        return sum(holder.nbytes for holder in held if holder is not None)

    def longest_prefix(self, tokens: Sequence[int], salt: str | None = None) -> int:
        """The most tokens of `tokens` some entry of `salt` held at the end of its last
        request (safe from any thread; used to choose among ways to cut a long prompt)."""
        return longest_prefix(self._entries, token_array(tokens), salt)

    @property
    def nbytes(self) -> int:
        """Bytes the entries hold: K/V allocated and checkpoints (each shared snapshot once),
        plus `working`'s and entries handed to the disk tier and not yet written."""
        return self.usage().held_bytes

    def usage(self) -> Holdings:
        """What the entries hold, least recently used first, then the latest one when it is
        no longer kept (its request fed it nothing): shown, not counted. `held_bytes` is
        `nbytes`."""
        kept, latest = self.entries, self.latest
        unkept = [latest] if latest is not None and latest not in kept else []
        pending = self.store.pending_writes.nbytes if self.store is not None else 0
        return holdings(kept, unkept=unkept, outside_bytes=self._working_bytes() + pending)

    def persist(self, timeout_s: float | None = None) -> None:
        """Writes every entry to the disk tier now (and waits), so a restart finds them: the
        most recently used first, none started after `timeout_s` (a shutdown has a grace
        period: docker's is 10 s)."""
        if self.store is None:
            return
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        entries = sorted(self._entries, key=lambda e: e.last_used, reverse=True)
        for entry in self._in_use:  # the writer thread may read nothing lazy
            entry.cache.materialize()
        for written, entry in enumerate(entries):
            if deadline is not None and time.monotonic() > deadline:
                logger.warning(
                    "disk cache: %d of %d entries not saved: the %.0f s for saving ran out",
                    len(entries) - written,
                    len(entries),
                    timeout_s,
                )
                break
            self._write(entry, wait=True)
        self.store.flush()

    def drop_labelled(self, label: str) -> int:
        """Drops the entries of the shared domain (no salt) whose last request was labelled
        `label` (a conversation its client deleted), without writing them to the disk tier:
        an entry is freed only when asked for by its own label. One in use is dropped when
        its request ends (as `clear` drops it), and so is the entry of a request made before
        and run after (`fetch_nearest`'s `drops_before`).

        Returns:
            The number of entries dropped.
        """
        dropped = [e for e in self._entries if e.keyed_by == label and e.salt is None]
        for entry in dropped:
            self._drop(entry, write=False)
        self.deletions.add(label)
        return len(dropped)

    def clear(self) -> None:
        """Drops every entry and its memory (the disk tier keeps its files); entries in use
        stay with their requests and are dropped when released."""
        self._entries.clear()
        self.latest = None


def _log_lookup(num_tokens: int, reuse: int, how: str) -> None:
    if reuse:
        left = num_tokens - reuse
        logger.info(
            "prefix cache hit total=%d cached=%d left=%d (%s)", num_tokens, reuse, left, how
        )
    else:
        logger.info("prefix cache miss total=%d left=%d", num_tokens, num_tokens)
