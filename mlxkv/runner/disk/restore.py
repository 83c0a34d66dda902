"""A chain of disk blocks back into a `ModelCache`: which prefix its readable blocks restore,
their arrays joined, and either checked whole before use or handed to the model layer by layer
as their checks pass.

Owns `restore_chain`, with what a load leaves: its blocks marked used (the budget's order),
its read rate measured. Does not own reading and checking the files (`reading`), joining one
block's arrays to the next (`blocks`), which prefixes a chain can restore (`chains`), or what
a bad file does to the index (`bad_files`, through the callbacks the store passes).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from mlxkv.cache.model_cache import ModelCache
from mlxkv.cache.serialize import ArrayShapes, arrays_to_cache, check_shapes
from mlxkv.errors import CacheStateError
from mlxkv.runner.disk.blocks import BadBlock, join_blocks
from mlxkv.runner.disk.chains import StoredChain, partial_restores
from mlxkv.runner.disk.files import StoredEntry, touch
from mlxkv.runner.disk.reading import LayerStream, read_blocks, warn_unreadable

logger = logging.getLogger(__name__)


def restore_chain(
    chain: StoredChain,
    empty: ModelCache,
    *,
    trimmable: bool,
    streamed: bool,
    reject: Callable[[StoredEntry, Exception], None],
    discard: Callable[[Path, Exception], None],
    measured: Callable[[int, float], None],
    model_shapes: ArrayShapes | None = None,
) -> ModelCache | None:
    """`empty` filled with the longest prefix of `chain` its readable blocks restore (their
    files marked used); None when they restore none. A block that fails its read is `reject`ed
    (the read ends there); a block whose arrays are not of the model's `model_shapes`
    (`serialize.check_shapes`) is `discard`ed, and when the joined arrays do not make a cache
    the chain's last block is; an error that says nothing about the files (out of memory, a
    read error) keeps them. `streamed`: the
    headers alone checked here, each layer handed to the model once its sections passed
    (`reading.LayerStream`, which reports the checks' seconds to `measured`; checked whole,
    the load's seconds are)."""
    started = time.perf_counter()
    read = read_blocks(chain.blocks, reject, streamed=streamed)
    restores = partial_restores(chain, trimmable=trimmable)
    restores = [r for r in restores if len(r.blocks) <= len(read)]
    if not restores:
        return None
    restore = restores[-1]
    used = read[: len(restore.blocks)]
    try:
        check = None
        if model_shapes is not None:
            check = functools.partial(check_shapes, shapes=model_shapes)
        arrays, layout = join_blocks([block for _, block in used], restore.num_tokens, check)
        cache = arrays_to_cache(arrays, layout, restore.tokens.tolist(), empty)
        if streamed:
            headers = list(zip(restore.blocks, [header for header, _ in used], strict=True))
            checked = functools.partial(measured, restore.nbytes)
            cache.gate = LayerStream(headers, len(cache), reject, checked)
        else:
            mx.eval(cache.arrays())
    except BadBlock as bad:  # the one that lies: not its neighbours (shared by other chains)
        discard(restore.blocks[bad.index].path, bad)
        return None
    except (CacheStateError, ValueError, KeyError, TypeError, ArithmeticError) as why:
        discard(restore.blocks[-1].path, why)
        return None
    except (OSError, RuntimeError, MemoryError) as error:  # says nothing about the file
        warn_unreadable(restore.blocks[-1], error)
        return None
    _loaded(chain, restore, streamed, time.perf_counter() - started, measured)
    return cache


def _loaded(
    chain: StoredChain,
    restore: StoredChain,
    streamed: bool,
    seconds: float,
    measured: Callable[[int, float], None],
) -> None:
    """What a load of `restore` (of `chain`) in `seconds` leaves: its rate measured (checked
    whole), its blocks marked used, a line when it is shorter than the chain."""
    seconds = max(seconds, 1e-6)
    if not streamed:
        measured(restore.nbytes, seconds)
    for block in restore.blocks:
        touch(block.path)
    if restore is not chain:
        logger.info(
            "disk cache: restored %d of %d tokens (the blocks before the unreadable one)",
            restore.num_tokens,
            chain.num_tokens,
        )
    logger.debug(
        "disk cache load tokens=%d blocks=%d bytes=%d seconds=%.3f streamed=%s",
        restore.num_tokens,
        len(restore.blocks),
        restore.nbytes,
        seconds,
        streamed,
    )
