"""A cache entry cut into the disk tier's write jobs: one for each block of its tokens that is
neither on disk nor queued yet, with the block's arrays, header metadata and file name.

Owns `block_jobs`: the entry's arrays, its disk snapshots with them (`cache_to_arrays`), cut at
the block boundaries (`blocks.cut_block`), each job made only once the one before it has been
put (the generator is lazy), so a block another write queued meanwhile is skipped. Does not own
which blocks are written or queued (`store.DiskStore`, asked through `written`), the queue
(`writer`), the header format (`files.entry_metadata`) or one block's arrays (`blocks`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import numpy as np

from mlxkv.cache.model_cache import ModelCache
from mlxkv.cache.serialize import cache_to_arrays
from mlxkv.errors import NotSupportedError
from mlxkv.runner.disk.blocks import cut_block
from mlxkv.runner.disk.chains import block_ranges
from mlxkv.runner.disk.files import SUFFIX, entry_metadata
from mlxkv.runner.disk.writer import WriteJob

logger = logging.getLogger(__name__)


def block_jobs(
    cache: ModelCache,
    snapshots: dict[int, list[Any]],
    tokens: np.ndarray,
    keys: list[str],
    *,
    fingerprint: str,
    signature: str,
    salt: str | None,
    reply_start: int,
    block_tokens: int,
    kv_bits: int | None,
    max_bytes: int,
    written: Callable[[str], bool],
) -> Iterator[WriteJob]:
    """The write jobs of `cache`'s blocks (its token ids `tokens`, its blocks' keys `keys`)
    that `written` (a file name: written or queued) says are still to write, first to last.

    Args:
        cache: the entry; its arrays are read, not changed.
        snapshots: its disk snapshots (`ModelCache.take_disk_snapshots`), written with the
            blocks they fall in.
        fingerprint, signature: the model's and the cache layout's, as each header holds them.
        salt: the isolation domain the entry belongs to.
        reply_start: where its last request's reply began, in tokens.
        block_tokens: tokens per block; kv_bits: float K/V quantized to this many bits (None:
            as computed); max_bytes: the tier's budget: a larger block ends the jobs.

    Yields none (a warning logged) for an entry of a layer type that cannot be saved.
    """
    try:
        arrays, layout = cache_to_arrays(cache, snapshots)
    except NotSupportedError as why:
        logger.warning("disk cache: entry not saved: %s", why)
        return
    mx.eval(list(arrays.values()))  # views of evaluated buffers: cheap, and thread-free
    parents = [None, *keys[:-1]]
    for (start, end), key, parent in zip(
        block_ranges(tokens.size, block_tokens), keys, parents, strict=True
    ):
        if written(key + SUFFIX):
            continue  # a prefix another conversation (or an earlier turn) wrote
        block, block_layout = cut_block(arrays, layout, start, end, tokens.size, kv_bits)
        mx.eval(list(block.values()))
        nbytes = sum(a.nbytes for a in block.values())
        if nbytes > max_bytes:
            logger.info("disk cache: %d bytes not saved; the budget is %d", nbytes, max_bytes)
            return
        metadata = entry_metadata(
            fingerprint,
            signature,
            block_layout,
            tokens[start:end],
            salt=salt,
            reply_start=reply_start,
            parent=parent,
            start=start,
        )
        yield WriteJob(block, metadata, key + SUFFIX, nbytes)
