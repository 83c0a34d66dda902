"""The disk tier's files: their names, format and checks, and which files are its own.

Owns the file format (`FORMAT`: MLX's safetensors with mlxkv's metadata, a CRC-32 of its
header and one of each layer's section), names (`token_key`), a file's metadata
(`entry_metadata`), reading and checking a header (`read_header`, and `read_record` for the
index's `StoredEntry`) and sections (`check_sections`), and the rules for what this tier may
remove: regular files with its naming whose header says so, never a symlink, a pipe or
anything named otherwise. Does not own the
index (`store`) or the budget (`store`, `budget`).

File: `<directory>/<model key>/<block key>.safetensors` (16 and 32 hex digits), written by
MLX's safetensors writer; one block of a chain (`chains`): the K/V of its tokens and the state
layers' snapshots it holds (`blocks`). The block key is the sha256 of its token ids, its salt
and its parent's key, so it names every token before it too. Its header metadata holds the
format, the model's fingerprint, the cache's layout signature and the block's layout, its
token ids, its parent and start, where its conversation's reply began, a CRC-32 of each
layer's section (`sections`: the bytes of the arrays of model layer i, its K/V slice, state and
snapshots (`mlxkv.cache.serialize.layer_of`), in file order; 8 hex digits each) and a CRC-32 of
the header (`crc32`: the length prefix and the header, the sections filled in, its own value
read as the placeholder). Header and sections together cover every byte a load uses, and a
layer can be checked, and used, before the layers after it are read. The model key combines
fingerprint and signature, so models (or kv_bits settings) sharing a directory keep apart; the
fingerprint is checked again in every file.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import re
import socket
import struct
import uuid
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlxkv.cache.serialize import layer_of
from mlxkv.runner.disk.blocks import check_block, stops

logger = logging.getLogger(__name__)

# 5: a CRC per layer's section (4: one CRC of the whole file; 3: blocks for plain K/V models
# only, one file per entry for the others; 2: one file per entry, no chains; 1: the CRC
# covered the data alone)
FORMAT = "mlxkv-kv-5"
FORMAT_FAMILY = "mlxkv-kv-"  # files of any version are this tier's (older ones are removed)
SUFFIX = ".safetensors"
_FILE_NAME = re.compile(r"[0-9a-f]{32}\.safetensors")
_MODEL_DIRECTORY = re.compile(r"[0-9a-f]{16}")
# `.tmp-<pid>-<pid space>-<32 hex>`; before pid spaces were named, `.tmp-<pid>-<32 hex>`
TEMPORARY_NAME = re.compile(r"\.tmp-(\d+)-(?:([0-9a-f]{8})-)?[0-9a-f]{32}\.safetensors")
_CRC_FIELD = b'"crc32":"'
_SECTIONS_FIELD = b'"sections":"'
CRC_PLACEHOLDER = "00000000"
_CHUNK_BYTES = 16 * 2**20


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


def temporary_path(directory: Path) -> Path:
    """A new temporary file's path in `directory`, named by this process and its pid space
    (`TEMPORARY_NAME`: `bad_files.remove_if_orphaned` tells a dead writer's by them)."""
    return directory / f".tmp-{os.getpid()}-{pid_space()}-{uuid.uuid4().hex}{SUFFIX}"


@functools.cache
def pid_space() -> str:
    """8 hex digits naming the space this process's id lives in: the host (its name, and its
    machine id where Linux keeps one) and on Linux its pid namespace (a container's own), so
    that a process id read from a file name is only looked up where it means this kind of id."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    try:
        machine = Path("/etc/machine-id").read_text().strip()
    except OSError:
        machine = ""
    named = f"{socket.gethostname()}:{machine}:{namespace}"
    return hashlib.sha256(named.encode()).hexdigest()[:8]


def check_writable(directory: Path) -> None:
    """Creates `directory` and proves a file can be written in it.

    Raises:
        DiskStoreUnavailable: it cannot be created or written (says why).
    """
    probe = temporary_path(directory)
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


def own_files(directory: Path, named: re.Pattern[str] = _FILE_NAME) -> list[os.DirEntry]:
    """Regular files in `directory` whose names `named` matches whole (by default, as this
    tier names its block files): never a link, a pipe (opening one would block) or anything
    named otherwise."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    return [e for e in entries if named.fullmatch(e.name) and e.is_file(follow_symlinks=False)]


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


# Bytes an element of each safetensors dtype takes.
_ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
               "C64": 8}  # fmt: skip


@dataclass(frozen=True)
class Header:
    """A block file's header: its metadata, its arrays (name -> shape and safetensors dtype)
    and where each layer's section lies (`sections[i]`: the (start, end) byte ranges in the
    file of layer i's arrays, in file order)."""

    metadata: dict[str, str]
    sections: list[list[tuple[int, int]]]
    raw: bytes  # the length prefix and the header, as read
    arrays: dict[str, tuple[tuple[int, ...], str]]


def read_header(path: Path) -> Header:
    """A safetensors file's header, after checking that the file is exactly as long as its
    header says (a truncated file fails here) and each array's bytes as its shape and dtype
    say (counted in Python: MLX's own count wraps on a huge shape, and a shape the data does
    not fill fails only as MLX reads it, as if the disk had). A header that does not parse
    (nested too deep for Python included), or does not name this tier's format, raises
    BadFile with `ours` False."""
    with open(path, "rb") as file:
        head = file.read(8)
        if len(head) < 8:
            raise BadFile("truncated header", ours=False)
        (header_bytes,) = struct.unpack("<Q", head)
        size = os.fstat(file.fileno()).st_size
        if header_bytes > min(size, 100 * 2**20):
            raise BadFile("header length out of range", ours=False)
        raw = head + file.read(header_bytes)
        try:
            header = json.loads(raw[8:])
            metadata = header.pop("__metadata__")
            if not str(metadata.get("format", "")).startswith(FORMAT_FAMILY):
                raise BadFile("not an mlxkv cache file", ours=False)
            spans, arrays = {}, {}
            for name, array in header.items():
                spans[name] = tuple(int(o) for o in array["data_offsets"])
                arrays[name] = (tuple(int(n) for n in array["shape"]), str(array["dtype"]))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as error:
            raise BadFile(f"unreadable header ({error})", ours=False) from error
    for name, (shape, dtype) in arrays.items():
        _check_span(name, shape, dtype, spans[name])
    end = max((stop for _, stop in spans.values()), default=0)
    if 8 + header_bytes + end != size:
        raise BadFile(f"{size} bytes; its header describes {8 + header_bytes + end}")
    data_start = 8 + header_bytes
    num_sections = len(metadata.get("sections", "")) // len(CRC_PLACEHOLDER)
    sections: list[list[tuple[int, int]]] = [[] for _ in range(num_sections)]
    for name, (start, stop) in sorted(spans.items(), key=lambda item: item[1]):
        layer = layer_of(name)
        if metadata.get("format") == FORMAT and not 0 <= layer < num_sections:
            raise BadFile(f"array {name} lies in no layer's section")
        if 0 <= layer < num_sections:
            sections[layer].append((data_start + start, data_start + stop))
    return Header(metadata, sections, raw, arrays)


def _check_span(name: str, shape: tuple[int, ...], dtype: str, span: tuple[int, ...]) -> None:
    item_bytes = _ITEM_BYTES.get(dtype)
    if item_bytes is None or min(shape, default=0) < 0 or len(span) != 2:
        raise BadFile(f"array {name}: no shape of a known dtype ({dtype}, {shape})")
    if span[1] - span[0] != math.prod(shape) * item_bytes:
        raise BadFile(f"array {name}: its offsets do not hold its shape {shape} of {dtype}")


def entry_metadata(
    fingerprint: str,
    signature: str,
    layout: dict,
    tokens: np.ndarray,
    *,
    salt: str | None,
    reply_start: int,
    parent: str | None = None,
    start: int = 0,
) -> dict[str, str]:
    """The header metadata of a block's file, its CRC-32s still placeholders (`patch_crc`
    fills them in once the file is written): one per layer of `layout`."""
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
        "sections": CRC_PLACEHOLDER * len(layout["layers"]),
        **({"salt": salt} if salt else {}),
    }


def read_record(path: Path, fingerprint: str, signature: str) -> StoredEntry:
    """The index entry of the file at `path`, from its header.

    Raises:
        BadFile: the header does not parse, is for another version, model or cache layout,
            or does not match the file's name.
        OSError: the file cannot be read now.
    """
    header = read_header(path)
    metadata = header.metadata
    check_origin(metadata, FORMAT, fingerprint, signature)
    try:
        tokens = np.frombuffer(base64.b64decode(metadata["tokens"]), dtype="<u4")
        layout = json.loads(metadata["layout"])
        start = int(metadata.get("start", 0))
        checkpoints = stops(layout, start + tokens.size)
        reply_start = int(metadata.get("reply_start", start + tokens.size))
    except (KeyError, ValueError, TypeError, AttributeError, RecursionError) as error:
        raise BadFile(f"unreadable metadata ({error})") from error
    try:
        check_block(layout, header.arrays, tokens.size)
    except (KeyError, ValueError, TypeError, AttributeError, RecursionError) as error:
        raise BadFile(f"its arrays are not what its layout and tokens say ({error})") from error
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


def check_origin(metadata: dict[str, str], fmt: str, fingerprint: str, signature: str) -> None:
    """Raises BadFile unless a file's header names this format, model and cache layout."""
    if metadata.get("format") != fmt:
        raise BadFile(f"written by another version of mlxkv ({metadata.get('format')})")
    if metadata.get("fingerprint") != fingerprint:
        raise BadFile("written for another model (fingerprint differs)")
    if metadata.get("signature") != signature:
        raise BadFile("written for another cache layout")


def _header_crc(raw: bytes) -> int:
    """CRC-32 of a header (`Header.raw`) with its own CRC value read as the placeholder (so
    one header byte changed is caught like one data byte)."""
    at = raw.find(_CRC_FIELD)
    if at < 0:
        raise BadFile("no checksum in its header")
    at += len(_CRC_FIELD)
    return zlib.crc32(raw[:at] + CRC_PLACEHOLDER.encode() + raw[at + len(CRC_PLACEHOLDER) :])


def _section_crc(file: Any, spans: list[tuple[int, int]]) -> int:
    """CRC-32 of the bytes of `spans` ((start, end) in the file), one after another."""
    crc = 0
    for start, end in spans:
        file.seek(start)
        while start < end and (chunk := file.read(min(_CHUNK_BYTES, end - start))):
            crc = zlib.crc32(chunk, crc)
            start += len(chunk)
    return crc


def patch_crc(path: Path) -> None:
    """Writes the CRC-32 of each layer's section, then of the header, into their
    placeholders (same length, so no offset moves), and flushes the file to disk."""
    header = read_header(path)
    raw = header.raw
    with open(path, "r+b") as file:
        crcs = "".join(f"{_section_crc(file, spans):08x}" for spans in header.sections)
        at = raw.index(_SECTIONS_FIELD) + len(_SECTIONS_FIELD)
        raw = raw[:at] + crcs.encode() + raw[at + len(crcs) :]
        at = raw.index(_CRC_FIELD + CRC_PLACEHOLDER.encode()) + len(_CRC_FIELD)
        raw = raw[:at] + f"{_header_crc(raw):08x}".encode() + raw[at + len(CRC_PLACEHOLDER) :]
        file.seek(0)
        file.write(raw)
        file.flush()
        os.fsync(file.fileno())


def check_header(header: Header) -> None:
    """Raises BadFile unless the header's CRC matches (its sections' CRCs are then the ones
    written)."""
    if f"{_header_crc(header.raw):08x}" != header.metadata.get("crc32"):
        raise BadFile("its header does not match its checksum (corrupt)")


def check_sections(path: Path, header: Header, layers: Iterable[int]) -> None:
    """Raises BadFile unless the sections of `layers` match their CRCs (`header` checked
    first: `check_header`). Any thread: reads and CRCs release the GIL on large buffers."""
    crcs = header.metadata["sections"]
    with open(path, "rb") as file:
        for layer in layers:
            width = len(CRC_PLACEHOLDER)
            if (
                f"{_section_crc(file, header.sections[layer]):08x}"
                != crcs[layer * width : (layer + 1) * width]
            ):
                raise BadFile(f"layer {layer} does not match its checksum (corrupt)")


def touch(path: Path) -> None:
    """Marks a file as just used (the budget removes the least recently used first)."""
    with contextlib.suppress(OSError):
        os.utime(path)
