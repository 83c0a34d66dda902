"""Building the prompt cache a Runner uses: its entries' pool and, when asked for, the disk
tier in the model's own subdirectory.

Owns `make_pool`. Does not own the pool's policy (`mlxkv.cache.pool`), the file format
(`mlxkv.cache.store`) or the settings (`mlxkv.config.RunnerConfig`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from mlxkv.cache.model_cache import ModelCache
from mlxkv.cache.pool import CachePool
from mlxkv.cache.serialize import layout_signature
from mlxkv.cache.store import DiskStore
from mlxkv.cache.store_files import DiskStoreUnavailable
from mlxkv.config import RunnerConfig
from mlxkv.models.fingerprint import model_fingerprint
from mlxkv.models.loading import LoadedModel

logger = logging.getLogger(__name__)


def make_pool(
    loaded: LoadedModel, make_entry: Callable[[], ModelCache], config: RunnerConfig
) -> CachePool:
    """The pool for these settings, its disk tier indexed (a restart finds its files); a
    cache directory that cannot be written leaves the tier off, with a warning."""
    store = None
    if config.cache_dir is not None:
        empty: ModelCache = make_entry()
        try:
            store = DiskStore(
                config.cache_dir,
                fingerprint=model_fingerprint(loaded),
                signature=layout_signature(empty),
                max_bytes=config.cache_dir_bytes,
                trimmable=not empty.needs_checkpoints,
            )
        except DiskStoreUnavailable as error:
            logger.warning("disk tier off: %s; entries live in memory only", error)
    return CachePool(
        make_entry, max_entries=config.cache_entries, max_bytes=config.cache_bytes, store=store
    )
