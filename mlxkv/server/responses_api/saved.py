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
A file that cannot be read (damaged, or from a newer version) is one warning and left where
it is; temporary files a killed server left are removed (only this module's, named so).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fastapi import Request

logger = logging.getLogger(__name__)

# What a file's `version` says; a file of another version is not read (one warning).
FORMAT_VERSION = 1
_NAME = re.compile(r"(?P<key>(?:resp|conv)_[0-9a-f]{32})\.json")
_TEMPORARY = re.compile(r"\.(?:resp|conv)_[0-9a-f]{32}\.json\.tmp")
_LOCK_NAME = "lock"


class SavedFiles:
    """The files of one state directory, held by this process (`open`)."""

    def __init__(self, directory: Path, lock: int):
        self.directory = directory
        self._lock = lock  # the open lock file's descriptor, locked
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlxkv-saved")
        self._last: Future[None] | None = None  # the newest write or removal asked

    @classmethod
    def open(cls, directory: str | Path | None) -> SavedFiles | None:
        """The directory's files, taken for this process; None for no directory, or (one
        warning) where it cannot be made or written, or another process holds it: state is
        then kept in memory only."""
        if directory is None:
            return None
        directory = Path(directory).expanduser()
        try:
            directory.mkdir(parents=True, exist_ok=True)
            lock = os.open(directory / _LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as error:
            logger.warning(
                "responses: %s cannot be used (%s); kept in memory only", directory, error
            )
            return None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(lock)
            logger.warning(
                "responses: another server keeps its stored responses and conversations in %s;"
                " this one keeps them in memory only (give it another --cache-dir to keep them)",
                directory,
            )
            return None
        saved = cls(directory, lock)
        saved._remove_temporaries()
        return saved

    def read(self, prefix: str) -> Iterator[dict[str, Any]]:
        """The records of the files whose ids start with `prefix` ("resp_", "conv_"), oldest
        written first."""
        found = []
        for entry in _own_files(self.directory):
            if entry.name.startswith(prefix):
                with contextlib.suppress(OSError):  # gone meanwhile
                    found.append((entry.stat(follow_symlinks=False).st_mtime_ns, entry.path))
        for _, path in sorted(found):
            record = _read(Path(path))
            if record is not None:
                yield record

    def write(self, record: dict[str, Any]) -> None:
        """Writes `record` as the file of its `id`, behind: after every write asked before.
        The record must not change afterwards (pass a copy of what may)."""
        self._ask(self._write, record)

    def remove(self, key: str) -> None:
        """Removes the file of `key` (an id), behind, after every write asked before."""
        self._ask(self._remove, key)

    async def written(self) -> None:
        """Returns once every write and removal asked so far is done (a failed one was
        logged: memory still holds the entry)."""
        last = self._last
        if last is not None and not last.done():
            await asyncio.shield(asyncio.wrap_future(last))

    def close(self) -> None:
        """Finishes the writes asked, then lets the directory go."""
        self._writer.shutdown(wait=True)
        os.close(self._lock)  # the lock goes with it

    def _ask(self, work: Callable[[Any], None], argument: Any) -> None:
        try:
            self._last = self._writer.submit(work, argument)
        except RuntimeError:  # closed: a request that ended after the server's stop
            logger.warning("responses: the server has stopped; %s not kept on disk", work.__name__)

    def _write(self, record: dict[str, Any]) -> None:
        key = record["id"]
        path = self.directory / f"{key}.json"
        temporary = self.directory / f".{key}.json.tmp"
        try:
            data = json.dumps({"version": FORMAT_VERSION, **record}, ensure_ascii=False)
            temporary.write_text(data, encoding="utf-8")
            os.replace(temporary, path)
        except (OSError, RuntimeError, TypeError, ValueError) as error:
            logger.warning("responses: %s was not written to %s (%s)", key, self.directory, error)
            with contextlib.suppress(OSError):
                temporary.unlink(missing_ok=True)

    def _remove(self, key: str) -> None:
        try:
            (self.directory / f"{key}.json").unlink(missing_ok=True)
        except OSError as error:
            logger.warning("responses: %s.json could not be removed (%s)", key, error)

    def _remove_temporaries(self) -> None:
        """Temporary files a server killed mid-write left (this process holds the lock: no
        other is writing one)."""
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.directory):
                if _TEMPORARY.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)


def _own_files(directory: Path) -> list[os.DirEntry]:
    """Regular files named as this module names them (never a link)."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    return [e for e in entries if _NAME.fullmatch(e.name) and e.is_file(follow_symlinks=False)]


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


def saved_files(request: Request) -> SavedFiles | None:
    """The state files of the app serving `request` (None: kept in memory only)."""
    return request.app.state.saved


async def saved_to_disk(request: Request) -> None:
    """Returns once what the app was asked to keep so far is in its files (at once without)."""
    saved = saved_files(request)
    if saved is not None:
        await saved.written()
