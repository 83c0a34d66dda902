"""A chain of disk blocks back into a `ModelCache`: which prefix its readable blocks restore,
their arrays joined, and either checked whole before use or handed to the model layer by layer
as their checks pass.

Owns `restore_chain`. Does not own reading and checking the files (`reading`), joining one
block's arrays to the next (`blocks`), which prefixes a chain can restore (`chains`), or what
a bad file does to the index (`store`, through the callbacks it passes).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from mlxkv.cache.model_cache import ModelCache
from mlxkv.cache.serialize import arrays_to_cache
from mlxkv.errors import CacheStateError
from mlxkv.runner.disk.blocks import join_blocks
from mlxkv.runner.disk.chains import StoredChain, partial_restores
from mlxkv.runner.disk.files import StoredEntry
from mlxkv.runner.disk.reading import LayerStream, read_blocks, warn_unreadable


def restore_chain(
    chain: StoredChain,
    empty: ModelCache,
    *,
    trimmable: bool,
    streamed: bool,
    reject: Callable[[StoredEntry, Exception], None],
    discard: Callable[[Path, Exception], None],
    measured: Callable[[int, float], None],
) -> tuple[ModelCache, StoredChain] | None:
    """`empty` filled with the longest prefix of `chain` its readable blocks restore, and that
    prefix's chain; None when they restore none. A block that fails its read is `reject`ed
    (the read ends there); one whose arrays do not make a cache is `discard`ed; an error that
    says nothing about the file (out of memory, a read error) keeps it. `streamed`: the
    headers alone checked here, each layer handed to the model once its sections passed
    (`reading.LayerStream`, which reports the checks' seconds to `measured`)."""
    read = read_blocks(chain.blocks, reject, streamed=streamed)
    restores = partial_restores(chain, trimmable=trimmable)
    restores = [r for r in restores if len(r.blocks) <= len(read)]
    if not restores:
        return None
    restore = restores[-1]
    used = read[: len(restore.blocks)]
    try:
        arrays, layout = join_blocks([block for _, block in used], restore.num_tokens)
        cache = arrays_to_cache(arrays, layout, restore.tokens.tolist(), empty)
        if streamed:
            headers = list(zip(restore.blocks, [header for header, _ in used], strict=True))
            checked = functools.partial(measured, restore.nbytes)
            cache.gate = LayerStream(headers, len(cache), reject, checked)
        else:
            mx.eval(cache.arrays())
    except (CacheStateError, ValueError, KeyError, TypeError, ArithmeticError) as why:
        discard(restore.blocks[-1].path, why)
        return None
    except (OSError, RuntimeError, MemoryError) as error:  # says nothing about the file
        warn_unreadable(restore.blocks[-1], error)
        return None
    return cache, restore
