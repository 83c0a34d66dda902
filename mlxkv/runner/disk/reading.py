"""Reading a chain's blocks for a load: each file's checks run on worker threads, several files
at once and ahead of the engine thread, which hands each checked block to MLX as it comes.

Owns `read_blocks` and how many files are checked at once (`CHECK_THREADS`). Does not own the
checks themselves (`files`), what a failed check does to the index (`store`) or joining the
blocks into a cache (`blocks`).

Why threads: a load's largest share was the CRC pass (measured in docs/disk.md), one file after
another on the engine thread. `zlib.crc32` and file reads release the GIL on large buffers, so
checks on worker threads run in parallel with one another and with MLX reading the blocks
already checked (`mx.async_eval` of `mx.load`'s lazy arrays). MLX arrays are made on the engine
thread only (MLX ties arrays to the thread that built them); the workers touch bytes alone.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import mlx.core as mx

from mlxkv.runner.disk.files import (
    BadFile,
    StoredEntry,
    check_header,
    check_sections,
    read_header,
)

# Files checked at once: one per core, at most 4 (beyond that the disk, not the CRC, limits).
CHECK_THREADS = max(1, min(4, os.cpu_count() or 1))

# What a check or MLX's read may raise: `on_error` sorts them (the file's fault, or not).
READ_ERRORS = (BadFile, OSError, ValueError, KeyError, TypeError, RuntimeError, MemoryError)
ReadBlock = tuple[dict[str, mx.array], dict[str, Any]]  # a block's arrays and layout


def checked_layout(block: StoredEntry) -> dict[str, Any]:
    """A block file's layout after its header, size and every layer's CRC are checked (any
    thread).

    Raises:
        BadFile: it must not be loaded (`files.read_header`, `check_header`, `check_sections`).
        OSError: it cannot be read now (or is gone).
    """
    header = read_header(block.path)
    check_header(header)
    check_sections(block.path, header, range(len(header.sections)))
    return json.loads(header.metadata["layout"])


def read_blocks(
    blocks: Sequence[StoredEntry], on_error: Callable[[StoredEntry, Exception], None]
) -> list[ReadBlock]:
    """The arrays and layout of `blocks`' first files that pass their checks, in order: the
    read stops at the first that fails (`on_error(block, error)` says what to do with it; the
    checks not started are cancelled). Each block's arrays are being read by MLX
    (`mx.async_eval`) when it is returned; call on the engine thread."""
    read: list[ReadBlock] = []
    with ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="mlxkv-disk-check") as pool:
        checks: list[Future] = [pool.submit(checked_layout, block) for block in blocks]
        for block, check in zip(blocks, checks, strict=True):
            try:
                layout = check.result()
                arrays = mx.load(str(block.path))
            except READ_ERRORS as error:
                for later in checks:
                    later.cancel()
                on_error(block, error)
                break
            mx.async_eval(list(arrays.values()))
            read.append((arrays, layout))
    return read
