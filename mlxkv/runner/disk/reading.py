"""Reading a chain's blocks for a load: each file's checks run on worker threads, several files
at once and ahead of the engine thread, which hands each checked block to MLX as it comes.

Owns `read_blocks` (every file checked whole before its block is used), `LayerStream` (a
streamed restore: the blocks' layer sections checked in layer order while the model already
uses the layers checked; `mlxkv.cache.gate.LayerGate`) and how many checks run at once
(`CHECK_THREADS`). Does not own the
checks themselves (`files`), what a failed check does to the index (`bad_files`) or joining the
blocks into a cache (`blocks`).

Why threads: a load's largest share was the CRC pass (measured in docs/disk.md), one file after
another on the engine thread. `zlib.crc32` and file reads release the GIL on large buffers, so
checks on worker threads run in parallel with one another and with MLX reading the blocks
already checked (`mx.async_eval` of `mx.load`'s lazy arrays). MLX arrays are made on the engine
thread only (MLX ties arrays to the thread that built them); the workers touch bytes alone.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import mlx.core as mx

from mlxkv.errors import RestoreBroken
from mlxkv.platform.machine import cpu_cores
from mlxkv.runner.disk.files import (
    BadFile,
    Header,
    StoredEntry,
    check_header,
    check_sections,
    read_header,
)

logger = logging.getLogger(__name__)

# Files checked at once: one per core, at most 4 (beyond that the disk, not the CRC, limits).
CHECK_THREADS = min(4, cpu_cores())

# What a check or MLX's read may raise: `on_error` sorts them (the file's fault, or not).
READ_ERRORS = (BadFile, OSError, ValueError, KeyError, TypeError, RuntimeError, MemoryError)
ReadBlock = tuple[dict[str, mx.array], dict[str, Any]]  # a block's arrays and layout


def warn_unreadable(block: StoredEntry, error: Exception) -> None:
    """One warning for a block that cannot be read now for a reason that proves nothing about
    the file (out of descriptors, of memory): it is kept."""
    logger.warning(
        "disk cache: could not read %s now (%s); prefilling instead, the file is kept",
        block.path.name,
        error,
    )


def checked_header(block: StoredEntry, *, whole: bool = True) -> Header:
    """A block file's header after its size, header CRC and (`whole`) every layer's CRC are
    checked (any thread).

    Raises:
        BadFile: it must not be loaded (`files.read_header`, `check_header`, `check_sections`).
        OSError: it cannot be read now (or is gone).
    """
    header = read_header(block.path)
    check_header(header)
    if whole:
        check_sections(block.path, header, range(len(header.sections)))
    return header


def read_blocks(
    blocks: Sequence[StoredEntry],
    on_error: Callable[[StoredEntry, Exception], None],
    *,
    streamed: bool = False,
) -> list[tuple[Header, ReadBlock]]:
    """The headers, arrays and layouts of `blocks`' first files that pass their checks, in
    order: the read stops at the first that fails (`on_error(block, error)` says what to do
    with it; the checks not started are cancelled). Whole files are checked, and each block's
    arrays are being read by MLX (`mx.async_eval`) when returned; `streamed`: headers only,
    the arrays left lazy (a `LayerStream` checks their sections while they are used). Call on
    the engine thread."""
    read: list[tuple[Header, ReadBlock]] = []
    with ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="mlxkv-disk-check") as pool:
        checks = [pool.submit(checked_header, block, whole=not streamed) for block in blocks]
        for block, check in zip(blocks, checks, strict=True):
            try:
                header = check.result()
                layout = json.loads(header.metadata["layout"])
                arrays = mx.load(str(block.path))
            except READ_ERRORS as error:
                for later in checks:
                    later.cancel()
                on_error(block, error)
                break
            if not streamed:
                mx.async_eval(list(arrays.values()))
            read.append((header, (arrays, layout)))
    return read


class LayerStream:
    """The layer sections of a restore's blocks, checked on `CHECK_THREADS` worker threads in
    layer order (thread t checks layers t, t + CHECK_THREADS, ...; each in every block), as the
    `LayerGate` of the cache built from them: layer i may be used once its section passed in
    every block. The first that fails stops every check; `on_error(block, error)` hears it
    once, on the thread that next waits.

    Args:
        blocks: the restore's blocks, first to last, and their checked headers (`check_header`).
        on_checked: called with the seconds the checks took, when all passed (any thread).
    """

    def __init__(
        self,
        blocks: Sequence[tuple[StoredEntry, Header]],
        num_layers: int,
        on_error: Callable[[StoredEntry, Exception], None],
        on_checked: Callable[[float], None],
    ):
        self._blocks = list(blocks)
        self._ready = [threading.Event() for _ in range(num_layers)]
        self._on_error = on_error
        self._on_checked = on_checked
        self._failure: tuple[StoredEntry, Exception] | None = None
        self._reported = False
        self._lock = threading.Lock()
        self._left = num_layers
        self._started = time.perf_counter()
        for first in range(min(CHECK_THREADS, num_layers)):
            layers = range(first, num_layers, CHECK_THREADS)
            threading.Thread(
                target=self._check, args=(layers,), name="mlxkv-disk-stream", daemon=True
            ).start()

    def _check(self, layers: range) -> None:
        for layer in layers:
            for block, header in self._blocks:
                if self._failure is not None:
                    return
                try:
                    check_sections(block.path, header, [layer])
                except READ_ERRORS as error:
                    self._fail(block, error)
                    return
                except Exception as error:  # never a waiter left waiting for this thread
                    logger.exception("disk cache: checking %s failed", block.path.name)
                    self._fail(block, error)
                    return
            self._ready[layer].set()
            with self._lock:
                self._left -= 1
                done = self._left == 0
            if done:
                self._on_checked(time.perf_counter() - self._started)

    def _fail(self, block: StoredEntry, error: Exception) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = (block, error)
        for event in self._ready:  # every waiter wakes, and hears it
            event.set()

    def ready(self, index: int) -> bool:
        return self._ready[index].is_set()

    def wait(self, index: int) -> None:
        self._ready[index].wait()
        if self._failure is not None:
            if not self._reported:
                self._reported = True
                self._on_error(*self._failure)
            raise RestoreBroken(f"a layer of {self._failure[0].path.name} failed its check")

    def wait_all(self) -> None:
        for index in range(len(self._ready)):
            self.wait(index)
