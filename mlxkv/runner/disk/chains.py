"""Chains of blocks: a conversation on disk as blocks of its tokens, each file naming the block
before it, so a prefix that conversations share is stored once.

Owns `StoredChain` (the blocks that rebuild one prefix), `longest_chain` (which chain serves the
longest prefix of a prompt), `partial_restores` and `cheapest_restore` (which of a chain's first
blocks a load reads: all, the prefix that pays, or none), `superseded_by` (which blocks a new
one makes redundant), `broken` (which blocks lost a block before them) and `block_ranges`
(where a cache is cut). Does not own files, names or the index (`files`, `store`), nor a
block's arrays (`blocks`).

Terms:
  block   one file: the K/V of the tokens from its `start` to its end, for every layer, and
          the state layers' snapshots it holds (`blocks`);
  chain   blocks from a first one (no parent), each the parent of the next;
  tail    a chain's last block, shorter than a full block; the conversation's next turn writes
          a longer block beside it (same parent), which supersedes it.

Invariants:
  - a block's tokens begin where its parent's end (`start` = the parent's start + tokens);
  - a chain of a model with state layers (recurrent, sliding-window, chunked) is restored
    only to a length one of its blocks holds their state at (`StoredEntry.checkpoints`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from mlxkv.cache.prefix import common_prefix_length
from mlxkv.runner.disk.files import SUFFIX, StoredEntry

# Tokens per block: small enough that a turn rewrites little, large enough that a long
# conversation is few files.
BLOCK_TOKENS = 256


@dataclass(frozen=True)
class StoredChain:
    """The blocks that rebuild a prefix, first to last, and the length a load restores (within
    the last block: its end where every layer trims, else a length it holds the state at)."""

    blocks: tuple[StoredEntry, ...]
    num_tokens: int
    # The query it serves goes on from all its stored line holds: every block matched whole,
    # none stored after the last (a shifted entry's approximated K/V serve only such a query;
    # it is the prompt less its last token, so a retry of exactly the stored line is not one).
    goes_on: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes to read to load it."""
        return sum(block.nbytes for block in self.blocks)

    @property
    def tokens(self) -> np.ndarray:
        """The token ids it restores."""
        return np.concatenate([block.tokens for block in self.blocks])[: self.num_tokens]


def longest_chain(
    records: Iterable[StoredEntry], query: np.ndarray, *, trimmable: bool
) -> tuple[StoredChain | None, int]:
    """The chain of `records` that serves the longest prefix of `query`, and that length in
    tokens (None with 0 when none serves any). A chain goes on past a block only when all of
    it matches; it ends at the last block that holds a length it can be restored to (no block
    past it is read).
    `trimmable`: every layer trims (so any length; else a block's `checkpoints`)."""
    children: dict[str | None, list[StoredEntry]] = defaultdict(list)
    for record in records:
        children[record.parent].append(record)
    blocks: list[StoredEntry] = []
    parent, matched = None, 0
    best_blocks, best_tokens = 0, 0
    while True:
        best, best_key = None, (0, 0, 0)
        followers = children.get(parent, ())
        for block in followers:
            if block.start != matched:
                continue
            shared = common_prefix_length(block.tokens, query[matched:])
            # the longest match; then one that can be restored to; then the cheapest to read
            key = (shared, _usable(block, shared, trimmable), -block.nbytes)
            if shared and key > best_key:
                best, best_key = block, key
        if best is None:
            break
        blocks.append(best)
        if best_key[1]:
            best_blocks, best_tokens = len(blocks), best_key[1]
        matched += best_key[0]
        if best_key[0] < best.num_tokens:
            break
        parent = best.key
    if not best_blocks:
        return None, 0
    chain = tuple(blocks[:best_blocks])
    # every layer trims: the whole last block, read anyway, stays (it may serve its own
    # conversation's next turn); else the state layers exist only at `best_tokens`
    end = chain[-1].start + chain[-1].num_tokens if trimmable else best_tokens
    goes_on = best is None and not followers and best_blocks == len(blocks)
    return StoredChain(chain, end, goes_on), best_tokens


def partial_restores(chain: StoredChain, *, trimmable: bool) -> list[StoredChain]:
    """The chains of `chain`'s first blocks a load may stop at, shortest first, then `chain`
    itself: each ends at its last block's end (every layer trims) or at the last length its
    last block holds every layer's state at (a block holding none is no place to stop)."""
    restores = []
    for count, block in enumerate(chain.blocks[:-1], start=1):
        end = block.start + block.num_tokens if trimmable else max(block.checkpoints, default=0)
        if end:
            restores.append(StoredChain(chain.blocks[:count], end))
    return [*restores, chain]


def cheapest_restore(
    restores: list[StoredChain],
    reuse: int,
    target: int,
    read_bytes_per_s: float,
    prefill_tokens_per_s: float | None,
) -> StoredChain | None:
    """Which of `restores` (`partial_restores`) to load for a prompt whose first `target`
    tokens the longest serves, when memory already serves `reuse` of them: the one whose read
    plus the prefill of the tokens it leaves is quickest, None when prefilling from `reuse`
    is (a tie prefills: nothing read). Reading one costs its bytes at `read_bytes_per_s`;
    prefill `prefill_tokens_per_s` (None, not measured yet: the longest is loaded)."""
    if prefill_tokens_per_s is None:
        return restores[-1]

    def seconds(restore: StoredChain | None) -> float:
        if restore is None:
            return (target - reuse) / prefill_tokens_per_s
        restored = max(reuse, min(restore.num_tokens, target))
        return restore.nbytes / read_bytes_per_s + (target - restored) / prefill_tokens_per_s

    return min([None, *restores], key=seconds)


def _usable(block: StoredEntry, shared: int, trimmable: bool) -> int:
    """The longest length, in tokens from the chain's start, `block` restores a request to
    that shares `shared` of its tokens (0: none): all layers trim, or one of its checkpoints."""
    if trimmable:
        return block.start + shared
    return max((n for n in block.checkpoints if n <= block.start + shared), default=0)


def block_ranges(num_tokens: int, block_tokens: int) -> list[tuple[int, int]]:
    """(start, end) of each block of a cache holding `num_tokens`."""
    return [
        (start, min(start + block_tokens, num_tokens))
        for start in range(0, num_tokens, block_tokens)
    ]


def broken(records: Iterable[StoredEntry], kept: Callable[[str], bool]) -> list[StoredEntry]:
    """The blocks of `records` that lost a block before them, never loadable again: whose
    parent is neither among `records` nor `kept` (asked by key: on disk though not indexed,
    or about to be written), or is one of them; last first."""
    by_key = {record.key: record for record in records}
    gone: set[str] = set()
    for record in sorted(by_key.values(), key=lambda r: r.start):  # parents first
        parent = record.parent
        if parent is not None and (parent in gone or parent not in by_key and not kept(parent)):
            gone.add(record.key)
    return sorted((by_key[key] for key in gone), key=lambda r: r.start, reverse=True)


def superseded_by(
    record: StoredEntry,
    records: list[StoredEntry],
    *,
    trimmable: bool,
    followed: Iterable[str] = (),
) -> list[StoredEntry]:
    """The blocks of `records` that `record` makes redundant, with every block after them,
    last first (removed in this order, a process killed between two removals leaves no block
    without its parent): beside it in its chain (same salt, parent and start), no longer,
    holding its tokens up to their reply start (the same conversation, its reply maybe
    rendered back otherwise: the pool trims such an entry in place too), which `record`'s
    chain serves (every layer trims, or the reply starts in the blocks they share, or
    `record` has a checkpoint there). Not the blocks named in `followed` (file names: a
    queued write follows them) nor those before them."""

    def supersedes(other: StoredEntry) -> bool:
        served = min(other.num_tokens, max(1, other.reply_start - other.start))
        return (
            other is not record
            and (other.salt, other.parent, other.start)
            == (record.salt, record.parent, record.start)
            and other.num_tokens <= record.num_tokens
            and (
                trimmable
                or other.reply_start <= other.start
                or other.reply_start in record.checkpoints
            )
            and common_prefix_length(record.tokens, other.tokens) >= served
        )

    gone = [other for other in records if supersedes(other)]
    keys = {other.key for other in gone}
    for other in sorted(records, key=lambda r: r.start):  # parents before their blocks
        if other.parent in keys and other.key not in keys:
            gone.append(other)
            keys.add(other.key)
    by_key = {r.key: r for r in records}
    kept: set[str] = set()
    for name in followed:
        key: str | None = name.removesuffix(SUFFIX)
        while key in by_key and key not in kept:
            kept.add(key)
            key = by_key[key].parent
    return sorted((r for r in gone if r.key not in kept), key=lambda r: r.start, reverse=True)
