"""Chains of blocks: a conversation on disk as blocks of its tokens, each file naming the block
before it, so a prefix that conversations share is stored once.

Owns `StoredChain` (the blocks that rebuild one prefix), `longest_chain` (which chain serves the
longest prefix of a prompt), `superseded_by` (which blocks a new one makes redundant),
`cuttable` (whether a layout is cut into blocks), `block_ranges` (where a cache is cut) and
`cut_block`/`join_blocks` (a block's arrays, and the blocks' arrays put back together). Does
not own files, names or the index (`files`, `store`).

Terms:
  block   one file: the K/V of the tokens from its `start` to its end, for every layer;
  chain   blocks from a first one (no parent), each the parent of the next;
  tail    a chain's last block, shorter than a full block; the conversation's next turn writes
          a longer block beside it (same parent), which supersedes it.

Invariants:
  - a block's tokens begin where its parent's end (`start` = the parent's start + tokens);
  - a model whose layers cannot all be cut by token (recurrent, sliding-window, quantized)
    writes one block per entry: its whole state, with its checkpoints.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlxkv.cache.prefix import common_prefix_length
from mlxkv.runner.disk.files import StoredEntry

# Tokens per block: small enough that a turn rewrites little, large enough that a long
# conversation is few files.
BLOCK_TOKENS = 256
_TOKEN_AXIS = 2  # K/V arrays are (B, H, L, D)


@dataclass(frozen=True)
class StoredChain:
    """The blocks that rebuild a prefix, first to last."""

    blocks: tuple[StoredEntry, ...]

    @property
    def nbytes(self) -> int:
        """Bytes to read to load it."""
        return sum(block.nbytes for block in self.blocks)

    @property
    def num_tokens(self) -> int:
        return self.blocks[-1].start + self.blocks[-1].num_tokens

    @property
    def tokens(self) -> np.ndarray:
        return np.concatenate([block.tokens for block in self.blocks])


def longest_chain(
    records: Iterable[StoredEntry], query: np.ndarray, *, trimmable: bool
) -> tuple[StoredChain | None, int]:
    """The chain of `records` that serves the longest prefix of `query`, and that length in
    tokens (None with 0 when none serves any). A chain goes on past a block only when all of
    it is reused. `trimmable`: every layer trims (else a block serves its length or a
    checkpoint)."""
    children: dict[str | None, list[StoredEntry]] = defaultdict(list)
    for record in records:
        children[record.parent].append(record)
    blocks: list[StoredEntry] = []
    parent, matched = None, 0
    while True:
        best, best_key = None, (0, 0)
        for block in children.get(parent, ()):
            if block.start != matched:
                continue
            reuse = _usable(block, common_prefix_length(block.tokens, query[matched:]), trimmable)
            key = (reuse, -block.nbytes)  # the longest; then the cheapest to read
            if reuse and key > best_key:
                best, best_key = block, key
        if best is None:
            break
        blocks.append(best)
        matched += best_key[0]
        if best_key[0] < best.num_tokens:
            break
        parent = best.key
    return (StoredChain(tuple(blocks)) if blocks else None), matched


def _usable(block: StoredEntry, shared: int, trimmable: bool) -> int:
    """Tokens of `block` a request sharing `shared` of them may reuse: all layers trim, or it
    holds them all, or a checkpoint (whole-entry blocks start at 0)."""
    if trimmable or shared == block.num_tokens:
        return shared
    return max((n for n in block.checkpoints if n <= shared), default=0)


def block_ranges(num_tokens: int, block_tokens: int | None) -> list[tuple[int, int]]:
    """(start, end) of each block of a cache holding `num_tokens` (one block for the whole
    with `block_tokens` None)."""
    step = block_tokens or max(num_tokens, 1)
    return [(start, min(start + step, num_tokens)) for start in range(0, num_tokens, step)]


def cut_block(arrays: dict[str, mx.array], start: int, end: int) -> dict[str, mx.array]:
    """The K/V of tokens `start`..`end`, copied (a write in flight then holds no view of the
    cache's buffers, which the next request updates in place)."""
    return {
        name: mx.contiguous(array[:, :, start:end, :]) if array.ndim == 4 else array
        for name, array in arrays.items()
    }


def join_blocks(blocks: list[dict[str, mx.array]]) -> dict[str, mx.array]:
    """One block's arrays from the arrays of consecutive blocks."""
    if len(blocks) == 1:
        return blocks[0]
    return {
        name: mx.concatenate([block[name] for block in blocks], axis=_TOKEN_AXIS)
        for name in blocks[0]
    }


def superseded_by(
    record: StoredEntry, records: list[StoredEntry], *, trimmable: bool
) -> list[StoredEntry]:
    """The blocks of `records` that `record` makes redundant, with every block after them:
    beside it in its chain (same salt, parent and start), no longer, holding its tokens up to
    their reply start (the same conversation, its reply maybe rendered back otherwise: the
    pool trims such an entry in place too), which `record` serves (every layer trims, or it
    has a checkpoint there)."""

    def supersedes(other: StoredEntry) -> bool:
        served = min(other.num_tokens, max(1, other.reply_start - other.start))
        return (
            other is not record
            and (other.salt, other.parent, other.start)
            == (record.salt, record.parent, record.start)
            and other.num_tokens <= record.num_tokens
            and (trimmable or served in record.checkpoints)
            and common_prefix_length(record.tokens, other.tokens) >= served
        )

    gone = [other for other in records if supersedes(other)]
    keys = {other.key for other in gone}
    for other in sorted(records, key=lambda r: r.start):  # parents before their blocks
        if other.parent in keys and other.key not in keys:
            gone.append(other)
            keys.add(other.key)
    return gone


def cuttable(signature: str) -> bool:
    """True when every layer of the layout `signature` names is a plain `KVCache` (its arrays
    cut by token into blocks); False for anything else, a signature that is no layout too."""
    try:
        layers = json.loads(signature)
    except ValueError:
        return False
    return isinstance(layers, list) and all(
        isinstance(layer, list) and layer[:1] == ["KVCache"] for layer in layers
    )
