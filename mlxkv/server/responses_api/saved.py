"""What the Responses API stores, kept on disk as well as in memory (`ServerConfig.state_dir`;
`mlxkv serve` keeps it in its disk tier's directory): stored responses and conversations, so a
restarted server, one killed with `kill -9` included, still answers a `previous_response_id`,
an `item_reference` and a conversation's id as it did before it stopped (the AI SDK's and the
OpenAI Agents SDK's sessions go on where they were).

Owns the files: one JSON file per stored response (written once) and per conversation
(written again whole at each change), named by its id, each written to a temporary name and
renamed into place, in the order asked, on one writer thread. Memory stays what answers:
`history` and `conversations` write a file when their entry changes and remove it when the
entry leaves their bounds or is deleted, so the files are what memory holds, and they read
them all back at start, oldest first. A route awaits `saved_to_disk` before it answers, so
what a client was told was kept is in a file (the page cache: a process killed, not a power
cut, keeps it).

One server keeps a directory at a time (a lock on its `lock` file, let go when the process
ends however it ends); a second one started on it says so and keeps its state in memory only.
A file that cannot be read (damaged, of a newer version, or not of the shape its kind has:
`history` and `conversations` check their records) is one warning and left where it is;
temporary files a killed server left are removed (only this module's, named so). A write that
fails (a full disk) is one warning and removes the entry's older file, so a restart forgets
the entry rather than read back an older state of it. The files are the user's
conversations: only their owner may read them (the directory 0700, the files 0600).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fastapi import Request

from mlxkv.runner.disk.files import own_files

logger = logging.getLogger(__name__)

# What a file's `version` says; a file of another version is not read (one warning).
FORMAT_VERSION = 1
KEY = re.compile(r"(?:resp|conv)_[0-9a-f]{32}")  # the ids kept in files: the files' names
_NAME = re.compile(rf"{KEY.pattern}\.json")
_TEMPORARY = re.compile(rf"\.{KEY.pattern}\.json\.tmp")
_LOCK_NAME = "lock"
# Encodes in pieces, the pure-Python way: a whole large record encoded at once holds the GIL
# (and the event loop) for its whole length; 30 MiB held it 0.7 s.
_ENCODER = json.JSONEncoder(ensure_ascii=False)


class SavedFiles:
    """The files of one state directory, held by this process (`open`, until `close`)."""

    def __init__(self, directory: Path, lock: int):
        self.directory = directory
        self._lock: int | None = lock  # the open lock file's descriptor, locked
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlxkv-saved")
        self._last: Future[None] | None = None  # the newest write or removal asked
        self.num_read = 0  # records `read` gave
        # The newest file time set (ns): each write and touch sets a later one, so that the
        # order they came in is the order read (a file system's own times can tie: ext4's
        # within a few ms, HFS+'s within a second, and ties were read in the order of ids).
        self._stamp_ns = 0

    @classmethod
    def open(cls, directory: str | Path | None) -> SavedFiles | None:
        """The directory's files, taken for this process; None for no directory, or (one
        warning) where it cannot be made, written or locked, or another process holds it:
        state is then kept in memory only."""
        if directory is None:
            return None
        directory = Path(directory).expanduser()
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            lock = os.open(directory / _LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as error:
            logger.warning(
                "responses: %s cannot be used (%s); kept in memory only", directory, error
            )
            return None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(lock)
            held = error.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
            why = (
                "another server keeps its state there" if held else f"it cannot be locked: {error}"
            )
            logger.warning(
                "responses: stored responses and conversations are kept in memory only, not in"
                " %s (%s; give this server another --cache-dir to keep them)",
                directory,
                why,
            )
            return None
        saved = cls(directory, lock)
        saved._remove_temporaries()
        return saved

    def read(
        self, prefix: str, error_of: Callable[[dict[str, Any]], str | None]
    ) -> Iterator[dict[str, Any]]:
        """The records of the files whose ids start with `prefix` ("resp_", "conv_"), the least
        recently written or used first (`touch`); one `error_of` finds wrong (what keeps it
        from being of its kind) is one warning, its file left, and is not given."""
        found = []
        for entry in own_files(self.directory, _NAME):
            if entry.name.startswith(prefix):
                with contextlib.suppress(OSError):  # gone meanwhile
                    found.append((entry.stat(follow_symlinks=False).st_mtime_ns, entry.path))
        for stamp_ns, path in sorted(found):
            self._stamp_ns = max(self._stamp_ns, stamp_ns)
            record = _read(Path(path))
            why = None if record is None else error_of(record)
            if why is not None:
                logger.warning("responses: %s is not read (%s); left as it is", path, why)
            elif record is not None:
                self.num_read += 1
                yield record

    def write(self, record: dict[str, Any]) -> None:
        """Writes `record` as the file of its `id`, behind: after every write asked before.
        The record must not change afterwards (pass a copy of what may)."""
        self._ask(self._write, record)

    def remove(self, key: str) -> None:
        """Removes the file of `key` (an id), behind, after every write asked before."""
        self._ask(self._remove, key)

    def touch(self, key: str) -> None:
        """Marks the file of `key` as just used, behind: a restart reads the files in the
        order they were last written or used, so that the bounds then drop those memory would
        have dropped (in the order written, one used at every turn went first)."""
        self._ask(self._touch, key)

    async def written(self) -> None:
        """Returns once every write and removal asked so far is done (one writer: the newest
        is done last)."""
        last = self._last
        if last is not None and not last.done():
            await asyncio.shield(asyncio.wrap_future(last))

    def close(self) -> None:
        """Finishes the writes asked, then lets the directory go (once)."""
        self._writer.shutdown(wait=True)
        lock, self._lock = self._lock, None
        if lock is not None:
            os.close(lock)  # the lock goes with it

    def _ask(self, work: Callable[[Any], None], argument: Any) -> None:
        try:
            self._last = self._writer.submit(work, argument)
        except RuntimeError:  # closed: a request that ended after the server's stop
            logger.warning("responses: a change after the server stopped is not kept on disk")

    def _write(self, record: dict[str, Any]) -> None:
        key = record.get("id")
        if not isinstance(key, str) or not KEY.fullmatch(key):  # never another name, nor a path
            logger.warning("responses: %r is not an id kept in a file", key)
            return
        temporary = self.directory / f".{key}.json.tmp"
        try:
            opened = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with open(opened, "w", encoding="utf-8") as file:
                for piece in _ENCODER.iterencode({"version": FORMAT_VERSION, **record}):
                    file.write(piece)
            os.utime(temporary, ns=self._next_stamp())
            os.replace(temporary, self.directory / f"{key}.json")
        except Exception as error:  # whatever it is, not a request's to answer for
            logger.warning(
                "responses: %s was not written to %s (%s); a restart will not read it back",
                key,
                self.directory,
                error,
            )
            with contextlib.suppress(OSError):
                temporary.unlink(missing_ok=True)
            self._remove(key)  # its older state is not read back as if it were this one

    def _remove(self, key: str) -> None:
        if not isinstance(key, str) or not KEY.fullmatch(key):
            return
        try:
            (self.directory / f"{key}.json").unlink(missing_ok=True)
        except Exception as error:  # only costs disk space
            logger.warning("responses: %s.json could not be removed (%s)", key, error)

    def _touch(self, key: str) -> None:
        if isinstance(key, str) and KEY.fullmatch(key):
            with contextlib.suppress(OSError):  # gone meanwhile, or not written
                os.utime(self.directory / f"{key}.json", ns=self._next_stamp())

    def _next_stamp(self) -> tuple[int, int]:
        """(access, modification) times for the next write or touch (the writer's thread)."""
        self._stamp_ns = max(time.time_ns(), self._stamp_ns + 1)
        return self._stamp_ns, self._stamp_ns

    def _remove_temporaries(self) -> None:
        """Temporary files a server killed mid-write left (this process holds the lock: no
        other is writing one)."""
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.directory):
                if _TEMPORARY.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)


def _read(path: Path) -> dict[str, Any] | None:
    """The file's record; None (one warning, the file left) when it cannot be read."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        logger.warning("responses: %s cannot be read (%s); left as it is", path, error)
        return None
    if not isinstance(record, dict) or record.get("version") != FORMAT_VERSION:
        logger.warning("responses: %s is not of version %d; left as it is", path, FORMAT_VERSION)
        return None
    if record.get("id") != path.stem:
        logger.warning("responses: %s holds another id; left as it is", path)
        return None
    return record


def items_error(value: Any) -> str | None:
    """What is wrong with `value` as a list of items (dicts, each with a string id)."""
    if not isinstance(value, list):
        return "its items are not a list"
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("id"), str):
            return "an item is not an object with an id"
    return None


async def saved_to_disk(request: Request) -> None:
    """Returns once what the app serving `request` was asked to keep so far is in its files
    (at once when it keeps them in memory only)."""
    saved: SavedFiles | None = request.app.state.saved
    if saved is not None:
        await saved.written()
