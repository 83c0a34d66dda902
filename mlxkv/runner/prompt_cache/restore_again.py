"""A request's restore that broke while its prefill used it, loaded again.

Owns `restore_again`. A streamed restore (`mlxkv.runner.disk.reading.LayerStream`) hands the
prefill each layer as its sections pass their checks; one that fails raises `RestoreBroken`
from the model's call (`mlxkv.cache.gate`), with the layers put back as they were and the bad
file discarded. Nothing computed from the restore is kept: the entry is emptied and loaded
again from the blocks the disk still holds (the ones before the bad one, each checked whole
before use), and the request feeds the rest. Does not own the choice to load (`pool`) or the
checks (`mlxkv.runner.disk`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from mlxkv.runner.disk.snapshots import boundaries
from mlxkv.runner.disk.store import DiskStore
from mlxkv.runner.prompt_cache.entry import token_array
from mlxkv.runner.prompt_cache.pool import PrefixHit

logger = logging.getLogger(__name__)


def restore_again(store: DiskStore, hit: PrefixHit, tokens: Sequence[int]) -> PrefixHit:
    """`hit` (on the request's prompt `tokens`) after its entry's streamed restore broke: its
    entry emptied, then holding what the disk restores now, checked whole first; the same
    entry, claimed still, with the rest of `tokens` to feed and the same checkpoints and disk
    snapshots (in tokens from the prompt's start)."""
    entry = hit.entry
    entry.cache.free()
    query = token_array(tokens)
    chain, reuse = store.best(query, len(tokens) - 1, entry.salt)
    cache = None if chain is None else store.load(chain, entry.cache, streamed=False)
    if cache is None:
        entry.cache.free()
        reuse = 0
    else:
        reuse = cache.nearest_restorable(min(reuse, cache.num_tokens))
        cache.rewind_to(reuse)
    logger.info(  # the bad file had its warning
        "disk cache: a restore broke mid-prefill; %d tokens restored again from the blocks "
        "before the bad one (were %d), the rest prefilled",
        reuse,
        hit.num_cached,
    )
    entry.tokens = query[:reuse].copy()
    at = {hit.num_cached + point for point in hit.checkpoints}
    points = tuple(sorted(p - reuse for p in at if reuse < p < len(tokens)))
    snaps = boundaries(reuse, len(tokens), store.snapshot_every_tokens)
    return PrefixHit(entry, reuse, list(tokens[reuse:]), points, tuple(p - reuse for p in snaps))
