"""Where the disk tier snapshots a model's state layers: at block boundaries, as often as their
bytes allow.

Owns the cost rule (`snapshot_every_blocks`, with the K/V bytes it weighs,
`disk_kv_bytes_per_token`, and what the snapshots held cost a token, `snapshot_bytes_per_token`)
and the boundaries a prefill stops at to take them
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
from mlxkv.runner.disk.blocks import DISK_GROUP_SIZES

# The K/V bytes a block is taken to hold when the model has no layer that trims back (every
# layer recurrent, or a window): the rule then still bounds the snapshots' bytes, to about
# this much a block (4 KiB a token, below the K/V a token of the smallest attention models:
# SmolLM2-135M's is 45 KiB in float32).
MIN_BLOCK_KV_BYTES = 2**20


def snapshot_every_blocks(cost: SnapshotCost, block_tokens: int, kv_bits: int | None = None) -> int:
    """Every how many block boundaries the state layers are snapshotted for the disk: every one
    where a snapshot costs no more bytes than the K/V of a block (`block_tokens` tokens) of the
    layers that trim back as written (quantized with `kv_bits`, `cache_dir_kv_bits`), else
    every k-th with k = ceil(snapshot / block K/V). So the snapshots never cost more disk (and
    write time) than the K/V they sit beside, and a prompt diverging inside a stored chain
    restores to at most k blocks before where it diverges (LFM2's convolutions: a few KB a
    layer, every boundary; Qwen3-Next's delta-rule state: ~72 MB against ~6 MB of K/V a
    block, every 12th)."""
    block_kv_bytes = disk_kv_bytes_per_token(cost, kv_bits) * block_tokens or MIN_BLOCK_KV_BYTES
    return max(1, math.ceil(cost.snapshot_bytes / block_kv_bytes))


def disk_kv_bytes_per_token(cost: SnapshotCost, kv_bits: int | None) -> int:
    """The K/V bytes a token's layers that trim back take in a block on disk: float K/V
    quantized to `kv_bits` (`blocks.cut_block`: its groups' scales and biases in the float
    dtype), the rest as held."""
    if not kv_bits or not cost.float_kv_item_bytes:
        return cost.kv_bytes_per_token
    item_bytes = cost.float_kv_item_bytes
    elements = cost.float_kv_bytes_per_token // item_bytes
    quantized = math.ceil(elements * (kv_bits / 8 + 2 * item_bytes / DISK_GROUP_SIZES[0]))
    return cost.kv_bytes_per_token - cost.float_kv_bytes_per_token + quantized


def snapshot_bytes_per_token(cost: SnapshotCost, block_tokens: int, kv_bits: int | None) -> int:
    """The snapshots' bytes a token of a long prompt holds in memory until its turn is written
    (one snapshot every `snapshot_every_blocks` blocks): at most its K/V's on disk, so a disk
    tier at most doubles what a token costs while a request runs (`assembly.size_window`
    fits the context window with it)."""
    if not cost.snapshot_bytes:
        return 0
    every_tokens = snapshot_every_blocks(cost, block_tokens, kv_bits) * block_tokens
    return math.ceil(cost.snapshot_bytes / every_tokens)


def boundaries(start: int, end: int, every_tokens: int | None) -> tuple[int, ...]:
    """The multiples of `every_tokens` strictly between `start` and `end` (token positions): the
    snapshots a prefill of those tokens takes; none when `every_tokens` is None (no disk tier,
    or every layer trims back)."""
    if not every_tokens:
        return ()
    first = (start // every_tokens + 1) * every_tokens
    return tuple(range(first, end, every_tokens))
