"""What a ModelCache holds, in tokens and bytes, read in one walk of its layers and checkpoints.

Owns `Footprint` and `measure`, and `SnapshotCost` (what a snapshot of a model's state
layers costs beside its K/V, `snapshot_cost`). The pool's budget and the memory report need
these numbers together, for every entry after every request: one walk gives them all, where a
property per number walked the layers once each. Does not own the totals over several entries
(`usage.holdings`: checkpoints shared between entries are counted once there).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from mlxkv.cache.layer_ops import always_trimmable, layer_bytes, leaves
from mlxkv.cache.layers.chunked import ChunkedKVCache
from mlxkv.cache.layers.kv import KVCache
from mlxkv.cache.layers.window import SlidingWindowCache


@dataclass(frozen=True)
class Footprint:
    """A ModelCache's tokens and bytes at one moment.

    Attributes:
        num_tokens: tokens whose K/V (or recurrent state) the layers hold.
        used_bytes: bytes holding them.
        allocated_bytes: bytes the layers have allocated, unused slots included.
        checkpoint_bytes: bytes of the checkpoints' snapshots.
        snapshots: the checkpoints' snapshot layers. Copies of a cache share them (they are
            never changed in place): a total over several caches counts each object once.
    """

    num_tokens: int
    used_bytes: int
    allocated_bytes: int
    checkpoint_bytes: int
    snapshots: tuple[Any, ...]


def measure(
    layers: Sequence[Any], checkpoints: Iterable[Sequence[Any]], num_tokens: int
) -> Footprint:
    """The footprint of `layers` holding `num_tokens` tokens, with the snapshots of
    `checkpoints` (each a snapshot per layer or None; one shared by two counted once)."""
    sizes = [layer_bytes(layer) for layer in layers]
    # the caller's list: a consistent view even while a generation on another thread adds one
    unique = {id(saved): saved for snap in checkpoints for saved in snap if saved}
    snapshots = tuple(unique.values())
    return Footprint(
        num_tokens,
        used_bytes=sum(used for _, used in sizes),
        allocated_bytes=sum(allocated for allocated, _ in sizes),
        checkpoint_bytes=sum(saved.nbytes for saved in snapshots),
        snapshots=snapshots,
    )


@dataclass(frozen=True, kw_only=True)
class SnapshotCost:
    """What a snapshot of the layers that cannot trim back costs, beside the K/V of those
    that can.

    Attributes:
        snapshot_bytes: one snapshot of the state layers, each full (a recurrent layer's
            state; a sliding window's or an attention chunk's snapshot holding its window).
        kv_bytes_per_token: K/V bytes one token adds in the layers that trim back.
        float_kv_bytes_per_token: the part of those in float K/V layers (`KVCache`: what the
            disk tier's `cache_dir_kv_bits` quantizes), and `float_kv_item_bytes` the bytes of
            one of their elements (0: none).
    """

    snapshot_bytes: int
    kv_bytes_per_token: int
    float_kv_bytes_per_token: int = 0
    float_kv_item_bytes: int = 0

    def held_bytes(self, tokens: int, checkpoints: int = 0, per_token_extra: int = 0) -> int:
        """Bytes a cache holding `tokens` tokens takes at most: the K/V that grow with them
        (plus `per_token_extra` a token), each state layer full (a window's whole window, a
        recurrent layer's state), and `checkpoints` snapshots of those."""
        growing = tokens * (self.kv_bytes_per_token + per_token_extra)
        return growing + self.snapshot_bytes * (1 + checkpoints)


def snapshot_cost(layers: Sequence[Any]) -> SnapshotCost:
    """`SnapshotCost` read from `layers` (a model's cache) holding exactly one token."""
    snapshot_bytes = kv_bytes = float_kv_bytes = item_bytes = 0
    for layer in leaves(layers):
        _, used = layer_bytes(layer)
        if always_trimmable(layer):
            kv_bytes += used
            if isinstance(layer, KVCache) and layer.keys is not None:
                float_kv_bytes += used
                item_bytes = layer.keys.dtype.size
        elif isinstance(layer, SlidingWindowCache):
            snapshot_bytes += used * layer.window
        elif isinstance(layer, ChunkedKVCache):
            snapshot_bytes += used * layer.chunk_size
        else:  # recurrent state, the same size at any length
            snapshot_bytes += used
    return SnapshotCost(
        snapshot_bytes=snapshot_bytes,
        kv_bytes_per_token=kv_bytes,
        float_kv_bytes_per_token=float_kv_bytes,
        float_kv_item_bytes=item_bytes,
    )
