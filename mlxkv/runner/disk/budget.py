"""The disk tier's budget: which files count against it and which go first.

Owns `tier_files` (every file under the cache root this tier wrote, any model's, proven by its
header: blocks, and other models' reply records), `temporary_bytes` (its temporary files, which
count but are never removed here) and `removal_order` (superseded files first, then the least
recently used). Does not remove anything (`store.DiskStore.enforce_budget`
does, through `store_files.remove_own_file`).
"""

from __future__ import annotations

import contextlib
import heapq
import os
import stat
from collections import Counter
from pathlib import Path

from mlxkv.cache.prefix import common_prefix_length
from mlxkv.runner.disk.files import (
    SUFFIX,
    TEMPORARY_NAME,
    BadFile,
    StoredEntry,
    model_directories,
    own_files,
    read_header,
)
from mlxkv.runner.disk.replies import record_files

FileInfo = tuple[Path, int, int]  # (path, bytes, mtime in ns)


def tier_files(
    root: Path, directory: Path, indexed: set[str], proven: dict[tuple[str, int, int], bool]
) -> list[FileInfo]:
    """(path, bytes, mtime) of every file under `root` this tier wrote: the blocks of
    `directory` (this model's) named in `indexed`, and other models' blocks and reply records
    whose header says so (this model's records count apart: `ReplyRecords.nbytes`). `proven`
    holds that answer by (path, size, mtime), so each header is read once; it is updated in
    place."""
    found = []
    for model_directory in model_directories(root):
        ours = model_directory == directory
        records = [] if ours else record_files(model_directory)
        for entry in [*own_files(model_directory), *records]:
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            key = (entry.path, info.st_size, info.st_mtime_ns)
            if ours and entry.name in indexed or not ours and _is_tier_file(key, proven):
                found.append((Path(entry.path), info.st_size, info.st_mtime_ns))
    return found


def temporary_bytes(directories: list[Path], proven: dict[tuple[str, int, int], bool]) -> int:
    """Bytes of the temporary files in `directories` whose header says this tier wrote them: a
    write in flight, or one a process killed mid-write left, removed only when provably
    orphaned (`bad_files.remove_if_orphaned`: at the next scan when its writer was a process of
    this pid space, an hour on otherwise). They take disk as blocks do, so the budget counts
    them; it never removes one (its writer may live in another container)."""
    total = 0
    for directory in directories:
        with contextlib.suppress(OSError):
            for entry in os.scandir(directory):
                if not TEMPORARY_NAME.fullmatch(entry.name):
                    continue
                with contextlib.suppress(OSError):  # renamed or removed meanwhile
                    info = entry.stat(follow_symlinks=False)
                    key = (entry.path, info.st_size, info.st_mtime_ns)
                    if stat.S_ISREG(info.st_mode) and _is_tier_file(key, proven):
                        total += info.st_size
    return total


def _is_tier_file(key: tuple[str, int, int], proven: dict[tuple[str, int, int], bool]) -> bool:
    if key not in proven:
        if len(proven) > 100_000:
            proven.clear()
        try:
            read_header(Path(key[0]))
            proven[key] = True
        except BadFile as why:
            proven[key] = why.ours
        except OSError:
            return False  # not proven ours; asked again next time
    return proven[key]


def removal_order(
    files: list[FileInfo],
    records: dict[str, StoredEntry],
    *,
    trimmable: bool,
    keep: Path | None,
    queued_after: frozenset[str] = frozenset(),
) -> list[FileInfo]:
    """`files` in the order the budget removes them: a block only after every block that
    follows it in a chain (a prefix shared by conversations stays while any of them uses it);
    among those free to go, files another file supersedes first (only when every layer can
    trim, so the longer file serves the shorter's tokens), then the least recently used;
    `keep` (the file just written) last, so it goes only when it alone is over the budget.
    `queued_after` (names of files a queued block follows) are never listed: removed, the
    block written next would be left without the blocks before it (never loadable)."""
    superseded = {
        name
        for name, record in records.items()
        if trimmable and any(_extends(other, record) for other in records.values())
    }
    by_name = {info[0].name: info for info in files}
    parent_of = {
        name: records[name].parent + SUFFIX
        for name in by_name
        if name in records and records[name].parent
    }
    children = Counter(parent for parent in parent_of.values() if parent in by_name)
    children.update(name for name in queued_after if name in by_name)

    def order_key(info: FileInfo) -> tuple:
        return (info[0] == keep, info[0].name not in superseded, info[2], info[0].name)

    ready = [(order_key(info), info) for info in files if children[info[0].name] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, info = heapq.heappop(ready)
        order.append(info)
        parent = parent_of.get(info[0].name)
        if parent is not None and parent in by_name:
            children[parent] -= 1
            if children[parent] == 0:
                heapq.heappush(ready, (order_key(by_name[parent]), by_name[parent]))
    return order


def _extends(longer: StoredEntry, shorter: StoredEntry) -> bool:
    """A whole entry (a block that starts its chain) holding a strict prefix of another's."""
    return (
        (longer.parent, longer.start) == (shorter.parent, shorter.start)
        and (longer.num_tokens > shorter.num_tokens)
        and (common_prefix_length(longer.tokens, shorter.tokens) == shorter.num_tokens)
    )
