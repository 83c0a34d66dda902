"""What a request reuses of a cache that is not its own yet: of a shifted one, how far its K/V
serve (`exact_part`, in memory and from the disk tier alike); from the disk tier, which chain
and how much of it a load reads (`load_nearest`).

Owns the rule for a shift's approximated K/V and a request's load from the disk tier, looked
up once more when a block it chose went before it was read. Does not own the entries (`pool`),
the index and files (`mlxkv.runner.disk.store`) or the read-or-prefill rule
(`mlxkv.runner.disk.chains.cheapest_restore`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from mlxkv.cache.model_cache import ModelCache
from mlxkv.runner.disk.chains import cheapest_restore, partial_restores
from mlxkv.runner.disk.store import DiskStore

logger = logging.getLogger(__name__)

# Lookups a load makes at most: the first, and one more when a block it chose went before its
# read (another process's write superseded it, or its budget removed it); a directory that
# changes under every load costs one more read, never a loop.
_MOST_LOOKUPS = 2


def load_nearest(
    store: DiskStore,
    query: np.ndarray,
    *,
    limit: int,
    reuse: int,
    salt: str | None,
    make_entry: Callable[[], ModelCache],
    prefill_tokens_per_s: float | None,
) -> tuple[ModelCache, int] | None:
    """The cache loaded from the chain of `salt`'s blocks on disk serving the longest prefix
    of `query` (at most `limit` tokens), and the tokens of `query` it serves: what pays of the
    chain (all of it, its first blocks, or none: `cheapest_restore`, by `prefill_tokens_per_s`
    and the store's measured read rate) when it serves more than `reuse` (memory's); else None.

    A load that read less than it chose (a block gone or unreadable since the lookup) looks up
    again, once, and loads what the directory holds then when that serves more: the request
    restores what the store holds at load time, not what was left of the lookup's choice."""
    found: tuple[ModelCache, int] | None = None
    for lookup in range(_MOST_LOOKUPS):
        if lookup:
            logger.info("disk cache: a block chosen went before its read; looking again")
        served = reuse if found is None else found[1]
        chain, disk_reuse = store.best(query, limit, salt)
        if chain is None or disk_reuse <= served:
            break
        restores = partial_restores(chain, trimmable=store.trimmable)
        rates = store.read_bytes_per_s, prefill_tokens_per_s
        if (restore := cheapest_restore(restores, served, disk_reuse, *rates)) is None:
            logger.debug("disk cache: prefilling %d tokens beats loading", disk_reuse - served)
            break
        cache = store.load(restore, make_entry())
        if cache is not None:
            restored = cache.nearest_restorable(min(disk_reuse, cache.num_tokens))
            restored = exact_part(cache, restored, goes_on=restore.goes_on)
            found = (cache, restored) if restored > served else found
        if cache is not None and cache.num_tokens >= restore.num_tokens:
            break  # read all it chose
    return found


def exact_part(cache: ModelCache, reuse: int, *, goes_on: bool) -> int:
    """What a request reuses of `reuse` tokens of `cache`. An in-place shift approximated the
    K/V past the tokens it kept (`exact_tokens`): a prompt that goes on past all the cache
    holds continues that text (as llama.cpp's shift does) and reuses it; one that parts from
    it earlier matches those tokens by chance (a chat's message marker right after the dropped
    ones) and would carry the approximation into every later turn, so it reuses the kept ones.
    A prompt equal to all it holds (a retry) continues nothing and asks for the reply to that
    text: the kept ones too, as a fresh Runner answers it (`StoredChain.goes_on` agrees)."""
    exact = cache.exact_tokens
    return reuse if goes_on or exact is None or reuse <= exact else exact
