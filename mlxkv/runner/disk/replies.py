"""The reply memory on disk: a record of each reply the model generated, so that a restarted
process (or a model loaded again) renders a reply sent back as the ids its blocks hold.

Owns the record's file (`<model directory>/<32 hex>.reply`: the disk tier's safetensors format
with no arrays, its header holding the salt, the reply's text (or the key a call reply is
known by, `text.replies.call_reply_key`), ids and context (what it was generated after,
`text.replies.reply_context`: two replies of one text are two records; a record written
before contexts were has none), where in a chain it ends, and a CRC-32 like
every block's), reading and checking one (`read_reply`), whether the blocks
on disk still hold its reply (`is_held`, over `IndexedBlocks`), and the records of one model
(`ReplyRecords`: made into write jobs, every one on disk indexed whoever wrote it, so the budget
counts them all, removed with their chains, written again when a block written holds their
reply again: `held_again`). Does not own the
in-memory reply memory (`mlxkv.runner.text.replies`) or the writer (`store`, `writer`).

Terms: a record's `anchor` is the key of the last whole block of the tokens through its
reply's end (the prompt, then the reply less its last id, which a reply cut by `max_tokens`
never fed), None when they fill no whole block; its `tail` is the tokens after that block. Its
reply is held while the anchor is indexed and a block after it begins with the tail: records of
chains the budget evicts (or that a later turn replaced with other ids) are removed with them.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlxkv.cache.prefix import common_prefix_length
from mlxkv.runner.disk.files import (
    CRC_PLACEHOLDER,
    FORMAT_FAMILY,
    BadFile,
    StoredEntry,
    check_header,
    check_origin,
    own_files,
    read_header,
    remove_own_file,
    token_key,
)
from mlxkv.runner.disk.writer import WriteJob

logger = logging.getLogger(__name__)

REPLY_FORMAT = f"{FORMAT_FAMILY}reply-1"
REPLY_SUFFIX = ".reply"
# Records gone kept in memory, to write again should a block hold their replies again: as
# many as the reply memory keeps (`mlxkv.runner.text.replies.MAX_REPLIES`).
MAX_GONE = 256
# 32 hex digits: a record without a context (as versions before contexts wrote); 40: with
# one, which those versions neither list nor remove (their names are 32 digits).
_NAME = re.compile(r"[0-9a-f]{32}(?:[0-9a-f]{8})?\.reply")


@dataclass(frozen=True, kw_only=True)
class StoredReply:
    """One record: the ids the model generated for `text` in `salt`'s domain."""

    path: Path
    salt: str | None
    text: str
    ids: list[int]
    anchor: str | None
    tail: np.ndarray
    tail_start: int  # where `tail` begins in its chain, in tokens
    context: str | None = None  # what it was generated after (None: a record that did not say)


def reply_name(salt: str | None, text: str, context: str | None = None) -> str:
    """The record's file name: one per (domain, text, context), as the memory keys them; one
    with a context 40 hex digits long (`_NAME`)."""
    said = f"{salt or ''}\n{text}" + ("" if context is None else f"\n{context}")
    digits = 32 if context is None else 40
    return hashlib.sha256(said.encode()).hexdigest()[:digits] + REPLY_SUFFIX


def reply_metadata(
    fingerprint: str,
    signature: str,
    *,
    salt: str | None,
    text: str,
    ids: np.ndarray,
    anchor: str | None,
    tail: np.ndarray,
    tail_start: int,
    context: str | None,
) -> dict[str, str]:
    """The header metadata of a record's file, its CRC-32 still the placeholder."""
    return {
        "format": REPLY_FORMAT,
        "fingerprint": fingerprint,
        "signature": signature,
        "text": text,
        "ids": _pack(ids),
        "tail": _pack(tail),
        "tail_start": str(tail_start),
        "crc32": CRC_PLACEHOLDER,
        "sections": "",  # no arrays: the header's CRC covers the whole record
        **({"anchor": anchor} if anchor else {}),
        **({"salt": salt} if salt else {}),
        **({"context": context} if context else {}),
    }


def read_reply(path: Path, fingerprint: str, signature: str) -> StoredReply:
    """The record at `path`, its header, size and CRC checked.

    Raises:
        BadFile: torn, corrupt, of another version, model or cache layout, or named otherwise
            than its domain and text.
        OSError: it cannot be read now.
    """
    header = read_header(path)
    metadata = header.metadata
    check_origin(metadata, REPLY_FORMAT, fingerprint, signature)
    check_header(header)
    try:
        text, salt = metadata["text"], metadata.get("salt") or None
        reply = StoredReply(
            path=path,
            salt=salt,
            text=text,
            ids=_unpack(metadata["ids"]).tolist(),
            anchor=metadata.get("anchor") or None,
            tail=_unpack(metadata["tail"]),
            tail_start=int(metadata["tail_start"]),
            context=metadata.get("context") or None,
        )
    except (KeyError, ValueError, TypeError) as error:
        raise BadFile(f"unreadable metadata ({error})") from error
    if path.name != reply_name(salt, text, reply.context) or not reply.ids:
        raise BadFile("its name does not match its reply")
    return reply


@dataclass
class IndexedBlocks:
    """The blocks indexed, as a record's check asks about them: every key, and the blocks by
    their parent's key (None: the first of a chain) and first token, so a check looks at the
    few that may begin with its tail, not at every block."""

    keys: set[str]
    children: dict[tuple[str | None, int], list[StoredEntry]]

    @classmethod
    def of(cls, records: Iterable[StoredEntry]) -> IndexedBlocks:
        indexed = cls(set(), {})
        for record in records:
            indexed.keys.add(record.key)
            if record.num_tokens:
                at = (record.parent, int(record.tokens[0]))
                indexed.children.setdefault(at, []).append(record)
        return indexed


def is_held(reply: StoredReply, blocks: IndexedBlocks) -> bool:
    """True while `blocks` hold the tokens through `reply`'s end in its domain: its anchor
    block (whose key names its tokens, salt and every block before it), and one after it
    that begins with its tail."""
    if reply.anchor is not None and reply.anchor not in blocks.keys:
        return False
    return reply.tail.size == 0 or any(
        block.start == reply.tail_start
        and block.salt == reply.salt
        and common_prefix_length(block.tokens, reply.tail) == reply.tail.size
        for block in blocks.children.get((reply.anchor, int(reply.tail[0])), [])
    )


class ReplyRecords:
    """The records of one model directory, every one on disk, whoever wrote it: indexed as
    the directory changes (`rescan`, with its blocks'), made into write jobs, removed when
    their chains go.

    Args:
        directory: the model's directory of the disk tier.
        fingerprint, signature: the model's and cache layout's, as its blocks carry them.
    """

    def __init__(self, directory: Path, fingerprint: str, signature: str):
        self.directory = directory
        self.fingerprint = fingerprint
        self.signature = signature
        self._lock = threading.Lock()  # guards _known, _by_text and _stamps
        self._known: dict[str, StoredReply] = {}  # by file name: the good records on disk
        # their names by (salt, text): a reply's records (one a context), found at once
        self._by_text: dict[tuple[str | None, str], set[str]] = {}
        # (bytes, mtime in ns) of each record file as last read, bad ones too (read once)
        self._stamps: dict[str, tuple[int, int]] = {}
        # the newest records removed (by any process) since indexed: a block written here
        # may hold their replies again (`held_again`)
        self._gone: OrderedDict[str, StoredReply] = OrderedDict()

    def job(
        self,
        through: np.ndarray,
        ids: list[int],
        said: tuple[str, str | None, str | None],
        block_tokens: int,
    ) -> WriteJob:
        """The write of the record of reply `ids`, `said` as (text, salt, context), whose chain
        holds `through` (its prompt and the reply less its last id) in blocks of
        `block_tokens`."""
        text, salt, context = said
        whole = through.size // block_tokens * block_tokens
        anchor = None
        for start in range(0, whole, block_tokens):
            anchor = token_key(through[start : start + block_tokens], salt, anchor)
        reply = StoredReply(
            path=self.directory / reply_name(salt, text, context),
            salt=salt,
            text=text,
            ids=list(ids),
            anchor=anchor,
            tail=through[whole:],
            tail_start=whole,
            context=context,
        )
        return self._job_of(reply)

    def _job_of(self, reply: StoredReply) -> WriteJob:
        metadata = reply_metadata(
            self.fingerprint,
            self.signature,
            salt=reply.salt,
            text=reply.text,
            ids=np.asarray(reply.ids),
            anchor=reply.anchor,
            tail=reply.tail,
            tail_start=reply.tail_start,
            context=reply.context,
        )
        return WriteJob({}, metadata, reply.path.name, 0)

    def held_again(self, block: StoredEntry, records: list[StoredEntry]) -> list[WriteJob]:
        """The writes of the records gone (`_gone`) whose replies `block`, just written, holds
        again with the blocks `records` (a turn that rendered the reply as its ids, written
        after the record went under budget pressure): written again behind it, a restart
        renders the reply as those ids, as this process does."""
        with self._lock:
            candidates = [
                reply
                for reply in self._gone.values()
                if reply.anchor == block.key
                or (reply.anchor, reply.tail_start) == (block.parent, block.start)
            ]
        if not candidates:
            return []
        blocks = IndexedBlocks.of(records)
        held = [reply for reply in candidates if is_held(reply, blocks)]
        with self._lock:
            for reply in held:
                self._gone.pop(reply.path.name, None)
        return [self._job_of(reply) for reply in held]

    def written(self, path: Path) -> None:
        """Indexes the record just renamed into place (`writer.write_file`)."""
        self._read(path, _stamp(path))

    def rescan(self) -> None:
        """Indexes the directory's records as they are now: new or rewritten ones read (one
        that must not be read is one warning, removed when its header proves it this
        tier's), those removed (by any process) forgotten. The store calls it with its own
        scan, when the directory changed."""
        present = {}
        for entry in record_files(self.directory):
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            present[entry.name] = (info.st_size, info.st_mtime_ns)
        with self._lock:
            for name in set(self._stamps) - set(present):
                self._stamps.pop(name)
                self._went(self._forget(name))
            changed = [n for n, stamp in present.items() if self._stamps.get(n) != stamp]
        for name in changed:
            self._read(self.directory / name, present[name])

    def _read(self, path: Path, stamp: tuple[int, int] | None) -> None:
        """Indexes the record at `path` as listed with `stamp`: not when it is gone or another
        file by the time its read ends (another process's sweep or write may run between the
        listing, the read and the index; the next scan looks at it again)."""
        try:
            reply = read_reply(path, self.fingerprint, self.signature)
        except BadFile as why:
            removed = why.ours and remove_own_file(path)
            logger.warning(
                "disk cache: ignoring reply record %s%s: %s",
                path.name,
                " (removed)" if removed else "",
                why,
            )
            reply = None
        except FileNotFoundError:  # removed since listed: another process's sweep
            reply = None
        except OSError as error:  # looked at again at the next scan
            logger.warning("disk cache: could not read %s now (%s)", path.name, error)
            return
        with self._lock:
            old = self._forget(path.name)
            self._stamps.pop(path.name, None)
            if stamp is None or (now := _stamp(path)) != stamp:
                if stamp is None or now is None:  # gone, not rewritten
                    self._went(old)
                return
            self._stamps[path.name] = stamp
            if reply is not None:
                self._known[path.name] = reply
                self._by_text.setdefault((reply.salt, reply.text), set()).add(path.name)
                self._gone.pop(path.name, None)

    def newest(self, limit: int) -> list[StoredReply]:
        """The newest `limit` records (by their files' times), oldest first: what a starting
        process's reply memory takes; the older stay on disk, found by `ids_of`."""
        with self._lock:
            by_time = sorted(self._known, key=lambda name: self._stamps[name][1], reverse=True)
            return [self._known[name] for name in by_time[:limit]][::-1]

    def ids_of(
        self, salt: str | None, text: str, queued: list[WriteJob]
    ) -> dict[str | None, list[int]] | None:
        """The ids of the records of `text` in `salt`'s domain by their contexts, oldest first
        (indexed, by their files' times, then `queued`: write jobs not written yet), else
        None: the reply memory's lookup of a reply it dropped (or never knew: every text
        sent back that it does not hold), so the process that wrote the record renders the
        reply as a restarted one, which reads it, does (the turn rendered so writes a chain
        that holds the record's reply)."""
        with self._lock:
            names = sorted(self._by_text.get((salt, text), ()), key=lambda n: self._stamps[n][1])
            found = {self._known[n].context: self._known[n].ids for n in names}
        for job in queued:
            said = job.metadata
            ours = said.get("format") == REPLY_FORMAT and said.get("salt") == (salt or None)
            if ours and said["text"] == text:
                context = said.get("context") or None
                found.pop(context, None)  # newer than the record written
                found[context] = _unpack(said["ids"]).tolist()
        return found or None

    def sweep(self, records: list[StoredEntry]) -> None:
        """Removes the records whose replies the blocks `records` no longer hold."""
        blocks = IndexedBlocks.of(records)
        with self._lock:
            known = list(self._known.values())
        for reply in known:
            if not is_held(reply, blocks):
                remove_own_file(reply.path)
                logger.debug("disk cache: reply record %s went with its chain", reply.path.name)
                with self._lock:
                    self._stamps.pop(reply.path.name, None)
                    self._went(self._forget(reply.path.name))

    def _forget(self, name: str) -> StoredReply | None:  # under the lock
        reply = self._known.pop(name, None)
        if reply is not None:
            names = self._by_text[reply.salt, reply.text]
            names.discard(name)
            if not names:
                del self._by_text[reply.salt, reply.text]
        return reply

    def _went(self, reply: StoredReply | None) -> None:  # under the lock
        if reply is not None:
            self._gone[reply.path.name] = reply
            while len(self._gone) > MAX_GONE:
                self._gone.popitem(last=False)

    @property
    def nbytes(self) -> int:
        """Bytes of the records indexed (any process's, as of the last `rescan`, and those
        written here since): they count in the directory's budget, and go with their chains
        (`sweep`)."""
        with self._lock:
            return sum(self._stamps[name][0] for name in self._known)


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        info = path.stat()
    except OSError:  # removed meanwhile (by another process's sweep)
        return None
    return info.st_size, info.st_mtime_ns


def record_files(directory: Path) -> list[os.DirEntry]:
    """Regular files named as records are (never a link or a pipe)."""
    return own_files(directory, _NAME)


def _pack(ids: np.ndarray) -> str:
    return base64.b64encode(np.asarray(ids, dtype="<u4").tobytes()).decode()


def _unpack(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype="<u4").astype(np.uint32)
