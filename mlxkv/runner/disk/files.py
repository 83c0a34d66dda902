"""The disk tier's files: their names, format and checks, and which files are its own.

Owns the file format (`FORMAT`: MLX's safetensors with mlxkv's metadata and a CRC-32 of the
whole file, header included), names (`token_key`), a file's metadata (`entry_metadata`),
reading and checking a header (`read_header`, and `read_record` for the index's
`StoredEntry`), and the rules for what this tier may remove: regular files with its naming
whose header says so, never a symlink, a pipe or anything named otherwise. Does not own the
index (`store`) or the budget (`store`, `budget`).

File: `<directory>/<model key>/<block key>.safetensors` (16 and 32 hex digits), written by
MLX's safetensors writer; one block of a chain (`chains`): the K/V of its tokens and the state
layers' snapshots it holds (`blocks`). The block key is the sha256 of its token ids, its salt
and its parent's key, so it names every token before it too. Its header metadata holds the
format, the model's fingerprint, the cache's layout signature and the block's layout, its
token ids, its parent and start, where its conversation's reply began, and a CRC-32 of the
whole file (header included, its own value read as the placeholder). The model key combines
fingerprint and signature, so models (or kv_bits settings) sharing a directory keep apart; the
fingerprint is checked again in every file.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import mlx.core as mx
import numpy as np

from mlxkv.runner.disk.blocks import stops
from mlxkv.runner.disk.writer import WriteJob

logger = logging.getLogger(__name__)

# 4: blocks for every layer kind (3: blocks for plain K/V models only, one file per entry for
# the others; 2: one file per entry, no chains; 1: the CRC covered the data alone)
FORMAT = "mlxkv-kv-4"
FORMAT_FAMILY = "mlxkv-kv-"  # files of any version are this tier's (older ones are removed)
SUFFIX = ".safetensors"
_FILE_NAME = re.compile(r"[0-9a-f]{32}\.safetensors")
_MODEL_DIRECTORY = re.compile(r"[0-9a-f]{16}")
TEMPORARY_NAME = re.compile(r"\.tmp-(\d+)-[0-9a-f]{32}\.safetensors")
_CRC_FIELD = b'"crc32":"'
CRC_PLACEHOLDER = "00000000"
_CHUNK_BYTES = 16 * 2**20
T = TypeVar("T")
# Seconds without a write after which a temporary file whose process is gone is removed.
ORPHAN_AGE_S = 3600.0


class BadFile(Exception):
    """A file that must not be loaded (the message says why). `ours`: its header says this
    tier wrote it (so it may be removed); a file whose header does not say so is left alone."""

    def __init__(self, message: str, *, ours: bool = True):
        super().__init__(message)
        self.ours = ours


@dataclass(eq=False)
class StoredEntry:
    """One indexed file.

    Attributes:
        path: where it is.
        tokens: the token ids it holds (uint32).
        nbytes: the file's size in bytes.
        checkpoints: the lengths, in tokens from its chain's start, it holds every layer's
            state at (`blocks.stops`): where a chain of a model with state layers may end.
        salt: the isolation domain it belongs to (a digest of a request's `cache_salt`), None
            for the shared.
        reply_start: where the reply of its last request began (tokens before it came from
            the client; its conversation's next turn renders the rest back, maybe otherwise),
            in tokens from the start of its chain.
        parent: the key (file name stem) of the block before it in its chain; None for the
            first.
        start: where its tokens begin in its chain, in tokens.
    """

    path: Path
    tokens: np.ndarray
    nbytes: int
    checkpoints: tuple[int, ...] = ()
    salt: str | None = None
    reply_start: int = 0
    parent: str | None = None
    start: int = 0

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.size)

    @property
    def key(self) -> str:
        return self.path.name.removesuffix(SUFFIX)


class DiskStoreUnavailable(OSError):
    """The cache directory cannot be written (read-only, no permission): serve without it."""


def check_writable(directory: Path) -> None:
    """Creates `directory` and proves a file can be written in it.

    Raises:
        DiskStoreUnavailable: it cannot be created or written (says why).
    """
    probe = directory / f".tmp-{os.getpid()}-{uuid.uuid4().hex}{SUFFIX}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise DiskStoreUnavailable(f"{directory} cannot be written ({error})") from error


def model_directories(root: Path) -> list[Path]:
    """The per-model folders this tier made under `root` (never followed through a link)."""
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []
    return [
        Path(e.path)
        for e in entries
        if _MODEL_DIRECTORY.fullmatch(e.name) and e.is_dir(follow_symlinks=False)
    ]


def own_files(directory: Path) -> list[os.DirEntry]:
    """Regular files in `directory` named as this tier names its files: never a link, a
    pipe (opening one would block) or anything named otherwise."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    return [e for e in entries if _FILE_NAME.fullmatch(e.name) and e.is_file(follow_symlinks=False)]


def remove_own_file(path: Path) -> bool:
    """Removes a file this tier wrote; False (one warning) where it cannot (a read-only
    directory), which only costs disk space."""
    try:
        path.unlink(missing_ok=True)
        return True
    except OSError as error:
        logger.warning("disk cache: could not remove %s (%s)", path.name, error)
        return False


def token_key(tokens: np.ndarray, salt: str | None = None, parent: str | None = None) -> str:
    """The file name stem for a block holding `tokens` in `salt`'s domain after the block
    `parent` (None: the first of its chain): equal ids, salt and parent, equal names, so the
    key chains every token before it (the model and cache layout are the directory's)."""
    digest = hashlib.sha256(np.asarray(tokens, dtype="<u4").tobytes())
    if salt:
        digest.update(f"\nsalt:{salt}".encode())
    if parent:
        digest.update(f"\nparent:{parent}".encode())
    return digest.hexdigest()[:32]


def read_header(path: Path) -> tuple[dict[str, str], int]:
    """A safetensors file's metadata and where its data starts, after checking that the file
    is exactly as long as its header says (a truncated file fails here). A header that does
    not parse, or does not name this tier's format, raises BadFile with `ours` False."""
    with open(path, "rb") as file:
        head = file.read(8)
        if len(head) < 8:
            raise BadFile("truncated header", ours=False)
        (header_bytes,) = struct.unpack("<Q", head)
        size = os.fstat(file.fileno()).st_size
        if header_bytes > min(size, 100 * 2**20):
            raise BadFile("header length out of range", ours=False)
        try:
            header = json.loads(file.read(header_bytes))
            metadata = header.pop("__metadata__")
            if not str(metadata.get("format", "")).startswith(FORMAT_FAMILY):
                raise BadFile("not an mlxkv cache file", ours=False)
            end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise BadFile(f"unreadable header ({error})", ours=False) from error
    if 8 + header_bytes + end != size:
        raise BadFile(f"{size} bytes; its header describes {8 + header_bytes + end}")
    return metadata, 8 + header_bytes


def entry_metadata(
    fingerprint: str,
    signature: str,
    layout: dict,
    tokens: np.ndarray,
    salt: str | None,
    reply_start: int,
    parent: str | None = None,
    start: int = 0,
) -> dict[str, str]:
    """The header metadata of a block's file, its CRC-32 still the placeholder (`patch_crc`
    fills it in once the file is written)."""
    return {
        "reply_start": str(reply_start),
        **({"parent": parent, "start": str(start)} if parent else {}),
        "format": FORMAT,
        "fingerprint": fingerprint,
        "signature": signature,
        "layout": json.dumps(layout),
        "num_tokens": str(tokens.size),
        "tokens": base64.b64encode(tokens.astype("<u4").tobytes()).decode(),
        "crc32": CRC_PLACEHOLDER,
        **({"salt": salt} if salt else {}),
    }


def read_record(path: Path, fingerprint: str, signature: str) -> StoredEntry:
    """The index entry of the file at `path`, from its header.

    Raises:
        BadFile: the header does not parse, is for another version, model or cache layout,
            or does not match the file's name.
        OSError: the file cannot be read now.
    """
    metadata, _ = read_header(path)
    if metadata.get("format") != FORMAT:
        raise BadFile(f"written by another version of mlxkv ({metadata.get('format')})")
    if metadata.get("fingerprint") != fingerprint:
        raise BadFile("written for another model (fingerprint differs)")
    if metadata.get("signature") != signature:
        raise BadFile("written for another cache layout")
    try:
        tokens = np.frombuffer(base64.b64decode(metadata["tokens"]), dtype="<u4")
        layout = json.loads(metadata["layout"])
        start = int(metadata.get("start", 0))
        checkpoints = stops(layout, start + tokens.size)
        reply_start = int(metadata.get("reply_start", start + tokens.size))
    except (KeyError, ValueError, TypeError) as error:
        raise BadFile(f"unreadable metadata ({error})") from error
    salt, parent = metadata.get("salt") or None, metadata.get("parent") or None
    if path.name != token_key(tokens, salt, parent) + SUFFIX:
        raise BadFile("its name does not match its token ids")
    return StoredEntry(
        path,
        tokens,
        path.stat().st_size,
        checkpoints,
        salt=salt,
        reply_start=reply_start,
        parent=parent,
        start=start,
    )


def _file_crc(file: Any, data_start: int) -> int:
    """CRC-32 of the whole file, header included, with the header's own CRC value read as
    the placeholder (so one header byte changed is caught like one data byte)."""
    file.seek(0)
    head = file.read(data_start)
    at = head.find(_CRC_FIELD)
    if at < 0:
        raise BadFile("no checksum in its header")
    at += len(_CRC_FIELD)
    crc = zlib.crc32(head[:at] + CRC_PLACEHOLDER.encode() + head[at + len(CRC_PLACEHOLDER) :])
    while chunk := file.read(_CHUNK_BYTES):
        crc = zlib.crc32(chunk, crc)
    return crc


def patch_crc(path: Path) -> None:
    """Writes the file's CRC-32 into the header's placeholder (same length, so no offset
    moves) and flushes the file to disk."""
    with open(path, "r+b") as file:
        (header_bytes,) = struct.unpack("<Q", file.read(8))
        header = file.read(header_bytes)
        at = header.index(_CRC_FIELD + CRC_PLACEHOLDER.encode()) + len(_CRC_FIELD)
        crc = _file_crc(file, 8 + header_bytes)
        file.seek(8 + at)
        file.write(f"{crc:08x}".encode())
        file.flush()
        os.fsync(file.fileno())


def write_file(
    directory: Path, job: WriteJob, lock: threading.RLock, index: Callable[[Path], T]
) -> T:
    """Writes `job` to `directory` so that its final name only ever holds it complete: under a
    temporary name, its CRC patched in and fsynced, renamed into place (with `index(path)`,
    under `lock`: a scan of the directory never sees one without the other), the directory
    fsynced. Returns what `index` returned.

    Raises:
        OSError: it could not be written (a full disk said so); no temporary file is left.
    """
    path = directory / job.name
    temporary = directory / f".tmp-{os.getpid()}-{uuid.uuid4().hex}{SUFFIX}"
    try:
        mx.save_safetensors(str(temporary), job.arrays, job.metadata)
        patch_crc(temporary)
        with lock:
            os.replace(temporary, path)
            indexed = index(path)
        fsync_directory(directory)  # the rename itself survives a power cut
    except RuntimeError as error:  # MLX says "Unable to write N bytes" and not why
        needed_bytes = sum(a.nbytes for a in job.arrays.values()) + len(json.dumps(job.metadata))
        raise OSError(why_unwritten(directory, needed_bytes, error)) from error
    finally:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
    return indexed


def fsync_directory(directory: Path) -> None:
    """Flushes `directory`'s entries (a rename just made in it) to disk, where the platform
    allows opening a directory (it does not on Windows: the rename is then as durable as the
    file system makes it)."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def check_crc(path: Path, data_start: int, metadata: dict[str, str]) -> None:
    with open(path, "rb") as file:
        crc = _file_crc(file, data_start)
    if f"{crc:08x}" != metadata.get("crc32"):
        raise BadFile("its contents do not match its checksum (corrupt)")


def touch(path: Path) -> None:
    """Marks a file as just used (the budget removes the least recently used first)."""
    with contextlib.suppress(OSError):
        os.utime(path)


def remove_orphaned_temporaries(directory: Path) -> None:
    """`remove_if_orphaned` for every temporary file in `directory`."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            if TEMPORARY_NAME.fullmatch(entry.name):
                remove_if_orphaned(Path(entry.path))


def remove_if_orphaned(path: Path) -> None:
    """Removes a temporary file whose writing process is gone (`.tmp-<pid>-...`) and that
    nothing has written for `ORPHAN_AGE_S`. The age matters: a server in another container
    sharing the directory has its own process ids, so its live writer looks gone from here."""
    try:
        info = path.lstat()
        if not stat.S_ISREG(info.st_mode) or time.time() - info.st_mtime < ORPHAN_AGE_S:
            return
        os.kill(int(path.name.split("-")[1]), 0)
    except ProcessLookupError:
        with contextlib.suppress(OSError):
            path.unlink()
    except (ValueError, IndexError, OSError):
        pass


def why_unwritten(directory: Path, needed_bytes: int, error: Exception) -> str:
    """MLX's write error with its likely cause (a full disk) spelled out."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return str(error)
    if free < needed_bytes + 2**20:
        return (
            f"the disk is full ({free:,} bytes free in {directory}, "
            f"the entry needs {needed_bytes:,})"
        )
    return str(error)
