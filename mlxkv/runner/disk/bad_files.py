"""What a disk-tier file that fails a read or a check leaves: the index forgets it, and it is
removed only when this tier wrote it.

Owns `BadFiles`, the rule behind the store's first two invariants: only files this tier wrote
are ever removed (a foreign one is left in place, warned about once); one that fails a check
is removed with one warning; one that could not be read for a reason that proves nothing about
the file (out of memory, of descriptors) is kept. Does not own the checks (`files`, `reading`),
the index (`store.DiskStore`, whose `forget` it calls under the store's directory lock, so a
scan never sees a file without its record) or the removal itself (`files.remove_own_file`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from mlxkv.runner.disk.files import BadFile, StoredEntry, remove_own_file
from mlxkv.runner.disk.reading import warn_unreadable

logger = logging.getLogger(__name__)


class BadFiles:
    """The store's handling of files that must not be loaded.

    Args:
        forget: drops a file name from the store's index.
        directory_lock: held while a file and its record change together (the store's).
    """

    def __init__(self, forget: Callable[[str], None], directory_lock: AbstractContextManager):
        self._forget = forget
        self._directory_lock = directory_lock
        self._strangers: set[str] = set()  # files here it did not write, warned about once

    def reject(self, block: StoredEntry, error: Exception) -> None:
        """What a block that failed to read (`reading.read_blocks`) leaves: gone, forgotten;
        corrupt or foreign, discarded; unreadable now for a reason that proves nothing about
        the file, kept."""
        # gone: MLX opening a file removed since its check (superseded) raises RuntimeError
        if isinstance(error, FileNotFoundError) or not block.path.exists():
            self._forget(block.path.name)
        elif isinstance(error, (BadFile, ValueError, KeyError, TypeError)):
            self.discard(block.path, error)
        else:
            warn_unreadable(block, error)

    def discard(self, path: Path, why: Exception) -> None:
        """Forgets a file that must not be loaded; removes it if this tier wrote it, else
        leaves it where it is (one warning per file)."""
        ours = not isinstance(why, BadFile) or why.ours
        with self._directory_lock:
            self._forget(path.name)
            removed = ours and remove_own_file(path)
        if not ours:
            if path.name not in self._strangers:
                self._strangers.add(path.name)
                logger.warning(
                    "disk cache: ignoring %s (%s): not a file this cache wrote; left in place",
                    path,
                    why,
                )
            return
        logger.warning(
            "disk cache: skipped %s %s: %s",
            "and removed" if removed else "(could not remove)",
            path.name,
            why,
        )
