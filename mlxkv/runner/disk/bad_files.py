"""What a disk-tier file that fails a read or a check leaves: the index forgets it, and it is
removed only when this tier wrote it; and the temporary files of writers that died mid-write
(`remove_orphaned_temporaries`).

Owns `BadFiles`, the rule behind the store's first two invariants: only files this tier wrote
are ever removed (a foreign one is left in place, warned about once); one that fails a check
is removed with one warning; one that could not be read for a reason that proves nothing about
the file (out of memory, of descriptors) is kept. Does not own the checks (`files`, `reading`),
the index (`store.DiskStore`, whose `forget` it calls under the store's directory lock, so a
scan never sees a file without its record) or the removal itself (`files.remove_own_file`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from mlxkv.runner.disk.files import (
    TEMPORARY_NAME,
    BadFile,
    StoredEntry,
    pid_space,
    read_header,
    remove_own_file,
)
from mlxkv.runner.disk.reading import warn_unreadable

logger = logging.getLogger(__name__)
# Seconds without a write after which a temporary file named in another pid space (another
# container's, another host's) whose process id is not running here is removed.
ORPHAN_AGE_S = 3600.0


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


def remove_orphaned_temporaries(directory: Path) -> None:
    """`remove_if_orphaned` for every temporary file in `directory`."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            if TEMPORARY_NAME.fullmatch(entry.name):
                remove_if_orphaned(Path(entry.path))


def remove_if_orphaned(path: Path) -> None:
    """Removes a temporary file whose writer is gone: named in this process's pid space
    (`files.pid_space`) by a process id not running (a server killed mid-write: its next start
    frees the disk it took, which the budget counts). One named in another space (another
    container's, whose ids mean nothing here) waits `ORPHAN_AGE_S` after its last write, and
    one named before spaces were, that and its id not running here. Any stays when its header
    does not prove it this tier's (a stranger named like one, even this space's: a user's file
    went; or a write killed within its first bytes: a few bytes, never counted in the
    budget), but for an empty one (nothing in it to lose)."""
    match = TEMPORARY_NAME.fullmatch(path.name)
    try:
        info = path.lstat()
        if match is None or not stat.S_ISREG(info.st_mode):
            return
        space = match.group(2)
        if space in (None, pid_space()) and _running(int(match.group(1))):
            return
    except (ValueError, OSError):
        return
    if space != pid_space() and time.time() - info.st_mtime < ORPHAN_AGE_S:
        return
    if info.st_size and _foreign(path):
        return
    with contextlib.suppress(OSError):
        path.unlink()


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's: it runs
        return True
    return True


def _foreign(path: Path) -> bool:
    try:
        read_header(path)
    except BadFile as why:
        return not why.ours
    except OSError:
        return True  # proves nothing: left for now
    return False
