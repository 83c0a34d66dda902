"""Where the disk tier snapshots a model's state layers: at block boundaries, as often as their
bytes allow.

Owns the cost rule (`snapshot_every_blocks`) and the boundaries a prefill stops at to take them
(`boundaries`). Does not own taking a snapshot (`mlxkv.cache.model_cache.ModelCache
.snapshot_for_disk`), measuring the layers (`mlxkv.cache.footprint.snapshot_cost`) or writing
them (`store`, `blocks`: each block holds the snapshots that fall in it).

Terms:
  boundary  an absolute token position that is a multiple of the block size: where a block of
            the chain ends, so a snapshot there lets a chain stop at the block's end.
"""

from __future__ import annotations

import math

from mlxkv.cache.footprint import SnapshotCost

# The K/V bytes a block is taken to hold when the model has no layer that trims back (every
# layer recurrent, or a window): the rule then still bounds the snapshots' bytes, to about
# this much a block (4 KiB a token, below the K/V a token of the smallest attention models:
# SmolLM2-135M's is 45 KiB in float32).
MIN_BLOCK_KV_BYTES = 2**20


def snapshot_every_blocks(cost: SnapshotCost, block_tokens: int) -> int:
    """Every how many block boundaries the state layers are snapshotted for the disk: every one
    where a snapshot costs no more bytes than the K/V of a block (`block_tokens` tokens) of the
    layers that trim back, else every k-th with k = ceil(snapshot / block K/V). So the
    snapshots never cost more disk (and write time) than the K/V they sit beside, and a prompt
    diverging inside a stored chain restores to at most k blocks before where it diverges
    (LFM2's convolutions: a few KB a layer, every boundary; Qwen3-Next's delta-rule state:
    ~72 MB against ~6 MB of K/V a block, every 12th)."""
    block_kv_bytes = cost.kv_bytes_per_token * block_tokens or MIN_BLOCK_KV_BYTES
    return max(1, math.ceil(cost.snapshot_bytes / block_kv_bytes))


def boundaries(start: int, end: int, every_tokens: int | None) -> tuple[int, ...]:
    """The multiples of `every_tokens` strictly between `start` and `end` (token positions): the
    snapshots a prefill of those tokens takes; none when `every_tokens` is None (no disk tier,
    or every layer trims back)."""
    if not every_tokens:
        return ()
    first = (start // every_tokens + 1) * every_tokens
    return tuple(range(first, end, every_tokens))
