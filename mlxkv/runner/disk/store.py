"""The disk tier: cache entries as safetensors files in a directory with its own byte budget.

Owns: the index of files, the background writer, loading a file back into a ModelCache, and
the directory's budget. Does not own the file format (`files`), which files count against
the budget and go first (`budget`), or which entry goes to disk or when a load pays
(see `pool`).

Invariants:
  - only files this tier wrote are ever removed: regular files (never a symlink, a pipe or a
    folder) named as it names them, whose header says they are an mlxkv file; anything else in
    the directory is left alone and not counted in the budget;
  - a file is never loaded unless its header parses, its fingerprint and signature match, its
    size is what the header says and its CRC matches; otherwise it is removed, with one
    warning. An error that proves nothing about the file (out of file descriptors, out of
    memory) keeps it: the request prefills instead, with a warning;
  - a file appears under its final name only complete: written under a temporary name, its CRC
    patched in, fsynced, then renamed (atomic) and its directory fsynced, so an interrupted
    write leaves at most a temporary file, which indexing ignores and removes once its
    process is gone;
  - a file is removed once a newer file of its salt holds its tokens and serves them (a
    conversation written behind turn after turn keeps one file);
  - two processes sharing the directory write identical content under identical names, and
    each picks up the other's new files when the directory changes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxkv.cache.model_cache import ModelCache
from mlxkv.cache.prefix import common_prefix_length
from mlxkv.cache.serialize import arrays_to_cache, cache_to_arrays
from mlxkv.errors import CacheStateError, NotSupportedError
from mlxkv.platform.threads import release_streams_at_thread_exit
from mlxkv.runner.disk.budget import removal_order, tier_files
from mlxkv.runner.disk.files import (
    SUFFIX,
    BadFile,
    StoredEntry,
    check_crc,
    check_writable,
    entry_metadata,
    fsync_directory,
    own_files,
    patch_crc,
    read_header,
    read_record,
    remove_orphaned_temporaries,
    remove_own_file,
    token_key,
    touch,
)

logger = logging.getLogger(__name__)

# A first guess at disk read speed, replaced by measurement after the first load.
DEFAULT_READ_BYTES_PER_S = 500 * 2**20


@dataclass
class _Job:
    """A background write. `held_bytes` is the memory its arrays keep alive until written:
    they are views of the entry's buffers, so the whole allocated buffers, not their slices'
    `nbytes`."""

    arrays: dict[str, mx.array]
    metadata: dict[str, str]
    name: str
    held_bytes: int


class DiskStore:
    """Cache entries on disk, indexed by their token ids.

    Args:
        root: the cache directory (shared by models; each gets a subdirectory).
        fingerprint: identifies the model's config and weights (hex).
        signature: the cache layout (`serialize.layout_signature`).
        max_bytes: most bytes all files under `root` may take; the oldest go first.
        trimmable: every layer can trim, so a file serves any prefix of its tokens (else only
            its own length and its checkpoints).
    """

    def __init__(
        self, root: Path, *, fingerprint: str, signature: str, max_bytes: int, trimmable: bool
    ):
        self.root = Path(root)
        key = hashlib.sha256(f"{fingerprint}\n{signature}".encode()).hexdigest()[:16]
        self.directory = self.root / key
        check_writable(self.directory)
        self.fingerprint = fingerprint
        self.signature = signature
        self.max_bytes = max_bytes
        self.trimmable = trimmable
        self.read_bytes_per_s = float(DEFAULT_READ_BYTES_PER_S)
        self._records: dict[str, StoredEntry] = {}
        self._lock = threading.Lock()  # guards _records, _queued, _pending_bytes and _writer
        self._pending_bytes = 0
        self._queued: dict[str, _Job] = {}  # handed to the writer, not yet written, by name
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        self._scanned_mtime = -1
        # other models' files proven this tier's, by (path, size, mtime): read once
        self._theirs: dict[tuple[str, int, int], bool] = {}
        self._strangers: set[str] = set()  # files here it did not write, warned about once
        self.refresh()
        self.enforce_budget()  # a smaller budget than the last run's holds from the start

    # -- index ----------------------------------------------------------------------------

    def refresh(self) -> None:
        """Indexes files added since the last scan (by any process) and forgets those removed;
        removes bad ones and temporary files left by processes that are gone."""
        mtime = self.directory.stat().st_mtime_ns
        if mtime == self._scanned_mtime:
            return
        complete = True
        present = set()
        with self._lock:
            known = set(self._records)
        for entry in own_files(self.directory):
            present.add(entry.name)
            if entry.name in known:
                continue
            path = Path(entry.path)
            try:
                record = read_record(path, self.fingerprint, self.signature)
            except BadFile as why:
                self._discard(path, why)
                continue
            except OSError as error:  # transient (or removed meanwhile): look again next time
                complete = complete and isinstance(error, FileNotFoundError)
                continue
            with self._lock:
                self._records[path.name] = record
        remove_orphaned_temporaries(self.directory)
        with self._lock:
            for name in set(self._records) - present - set(self._queued):
                del self._records[name]
        if complete:
            self._scanned_mtime = mtime

    def best(
        self, tokens: np.ndarray, limit: int, salt: str | None = None, *, rescan: bool = True
    ) -> tuple[StoredEntry | None, int]:
        """The file of `salt` that serves the longest prefix of `tokens` (at most `limit`
        tokens), and that length in tokens (0 with None when none serves any). Without
        `rescan`, among the files indexed now: safe from any thread (a scan removes bad files,
        the engine thread's job), for questions that must not change the cache."""
        if rescan:
            self.refresh()
        best, best_reuse = None, 0
        with self._lock:
            records = [r for r in self._records.values() if r.salt == salt]
        for record in records:
            reuse = min(common_prefix_length(record.tokens, tokens), limit)
            if reuse < record.num_tokens and not self.trimmable:
                reuse = max((n for n in record.checkpoints if n <= reuse), default=0)
            if reuse > best_reuse:
                best, best_reuse = record, reuse
        return best, best_reuse

    def holds(self, tokens: np.ndarray, salt: str | None = None) -> bool:
        """True when a file of `salt` holds exactly these tokens (written, indexed or queued
        for writing by this store)."""
        name = token_key(tokens, salt) + SUFFIX
        with self._lock:
            return name in self._records or name in self._queued

    # -- load -----------------------------------------------------------------------------

    def load(self, record: StoredEntry, empty: ModelCache) -> ModelCache | None:
        """Fills `empty` from `record`'s file; None (the file removed, one warning) when it is
        missing, truncated, corrupt or for another model."""
        start = time.perf_counter()
        try:
            metadata, data_start = read_header(record.path)
            check_crc(record.path, data_start, metadata)
            arrays = mx.load(str(record.path))
            layout = json.loads(metadata["layout"])
            cache = arrays_to_cache(arrays, layout, record.tokens.tolist(), empty)
            mx.eval(cache.arrays())
        except FileNotFoundError:
            self._forget(record.path.name)
            return None
        except (BadFile, CacheStateError, ValueError, KeyError, TypeError, ArithmeticError) as why:
            self._discard(record.path, why)
            return None
        except (OSError, RuntimeError, MemoryError) as error:  # says nothing about the file
            logger.warning(
                "disk cache: could not read %s now (%s); prefilling instead, the file is kept",
                record.path.name,
                error,
            )
            return None
        seconds = max(time.perf_counter() - start, 1e-6)
        self.read_bytes_per_s = record.nbytes / seconds
        touch(record.path)
        logger.debug(
            "disk cache load tokens=%d bytes=%d seconds=%.3f",
            record.num_tokens,
            record.nbytes,
            seconds,
        )
        return cache

    # -- write ----------------------------------------------------------------------------

    def write(
        self,
        cache: ModelCache,
        *,
        wait: bool = False,
        salt: str | None = None,
        kept: bool = False,
        reply_start: int | None = None,
    ) -> None:
        """Saves `cache` under its token ids: in the background (the arrays stay referenced,
        and count in `pending_bytes`, until written), or now with `wait`. An entry already on
        disk, empty, larger than the budget or of a layer type that cannot be saved is
        skipped. `salt`: the isolation domain the entry belongs to. `kept`: the entry stays in
        memory (a turn written behind as it ends), so its buffers are the pool's, not held
        for the writer alone, and do not count in `pending_bytes`. `reply_start`: where its
        last request's reply began (None: its end); a later file of its conversation that
        holds the tokens before it supersedes it."""
        tokens = np.asarray(cache.tokens, dtype=np.uint32)
        if tokens.size == 0 or self._claim_queued(token_key(tokens, salt) + SUFFIX, cache, kept):
            return
        try:
            arrays, layout = cache_to_arrays(cache)
        except NotSupportedError as why:
            logger.warning("disk cache: entry not saved: %s", why)
            return
        mx.eval(list(arrays.values()))  # views of evaluated buffers: cheap, and thread-free
        nbytes = sum(a.nbytes for a in arrays.values())
        if nbytes > self.max_bytes:
            logger.info(
                "disk cache: entry of %d bytes not saved; the budget is %d", nbytes, self.max_bytes
            )
            return
        metadata = entry_metadata(
            self.fingerprint, self.signature, layout, tokens, salt, reply_start
        )
        held_bytes = 0 if kept else cache.nbytes
        job = _Job(arrays, metadata, token_key(tokens, salt) + SUFFIX, held_bytes)
        if wait:
            self._run_logged(job)
            return
        with self._lock:
            self._pending_bytes += job.held_bytes
            self._queued[job.name] = job
            if self._writer is None:
                self._writer = threading.Thread(
                    target=self._write_loop, name="mlxkv-disk-writer", daemon=True
                )
                self._writer.start()
        self._jobs.put(job)

    def _claim_queued(self, name: str, cache: ModelCache, kept: bool) -> bool:
        """True when the file `name` is written, or queued: an entry written behind as its
        turn ended and evicted before it was written now counts its buffers as held for the
        writer (the pool no longer does)."""
        with self._lock:
            job = self._queued.get(name)
            if job is not None and not kept and job.held_bytes == 0:
                job.held_bytes = cache.nbytes
                self._pending_bytes += job.held_bytes
            return job is not None or name in self._records

    @property
    def pending_bytes(self) -> int:
        """Memory held by entries handed to the writer and not yet on disk."""
        with self._lock:
            return self._pending_bytes

    def flush(self) -> None:
        """Waits until every background write has finished."""
        self._jobs.join()

    def close(self) -> None:
        """Finishes pending writes and stops the writer thread, whose frame holds the store
        (and so its index) alive. Safe to call twice, from any thread, the writer's own
        included (a garbage collection there can run a Runner's finalizer); a later `write`
        starts a new writer."""
        with self._lock:
            writer, self._writer = self._writer, None
        if writer is None:
            return
        self._jobs.put(None)
        if writer is not threading.current_thread():
            writer.join()

    def _write_loop(self) -> None:
        release_streams_at_thread_exit()
        while (job := self._jobs.get()) is not None:
            try:
                self._run_logged(job)
            finally:
                with self._lock:
                    self._pending_bytes -= job.held_bytes
                    self._queued.pop(job.name, None)
                # the job's arrays (a whole entry) must not live on while this thread waits
                del job
                self._jobs.task_done()
        self._jobs.task_done()

    def _run_logged(self, job: _Job) -> None:
        """`_run`, a failure logged in one line: a failed write loses a cache entry, never
        the process (nor a shutdown)."""
        try:
            self._run(job)
        except (OSError, RuntimeError) as error:
            logger.warning("disk cache: entry %s not saved: %s", job.name, error)
        except Exception:
            logger.exception("disk cache: writing %s failed", job.name)

    def _run(self, job: _Job) -> None:
        path = self.directory / job.name
        temporary = self.directory / f".tmp-{os.getpid()}-{uuid.uuid4().hex}{SUFFIX}"
        start = time.perf_counter()
        try:
            mx.save_safetensors(str(temporary), job.arrays, job.metadata)
            patch_crc(temporary)
            os.replace(temporary, path)
            fsync_directory(self.directory)  # the rename itself survives a power cut
        except RuntimeError as error:  # MLX says "Unable to write N bytes" and not why
            raise OSError(_why_unwritten(self.directory, job, error)) from error
        finally:
            with contextlib.suppress(OSError):
                temporary.unlink(missing_ok=True)
        record = read_record(
            path, self.fingerprint, self.signature
        )  # the index entry, as a restart would read it
        with self._lock:
            self._records[job.name] = record
        self._remove_superseded(record)
        logger.debug(
            "disk cache write tokens=%d bytes=%d seconds=%.3f",
            record.num_tokens,
            record.nbytes,
            time.perf_counter() - start,
        )
        self.enforce_budget(keep=path)

    def _remove_superseded(self, record: StoredEntry) -> None:
        """Removes this model's files that `record` makes redundant: of its salt, shorter,
        holding its tokens up to their reply start (the same conversation, its reply maybe
        rendered back otherwise: the pool trims such an entry in place too), which `record`
        serves (every layer trims, or it has a checkpoint there). A conversation written
        behind turn after turn so keeps one file, not one per turn."""

        def supersedes(other: StoredEntry) -> bool:
            served = other.reply_start or other.num_tokens
            return (
                other is not record
                and other.salt == record.salt
                and other.num_tokens < record.num_tokens
                and (self.trimmable or served in record.checkpoints)
                and common_prefix_length(record.tokens, other.tokens) >= served
            )

        with self._lock:
            older = [other for other in self._records.values() if supersedes(other)]
        for other in older:
            if remove_own_file(other.path):
                logger.debug("disk cache superseded file=%s", other.path.name)
            self._forget(other.path.name)

    # -- budget ---------------------------------------------------------------------------

    def enforce_budget(self, keep: Path | None = None) -> None:
        """Removes this tier's files (of any model under `root`) until they fit in
        `max_bytes`: files another file supersedes first, then the least recently used."""
        with self._lock:
            indexed = set(self._records)
        files = tier_files(self.root, self.directory, indexed, self._theirs)
        total = sum(size for _, size, _ in files)
        if total <= self.max_bytes:
            return
        with self._lock:
            records = dict(self._records)
        for path, size, _ in removal_order(files, records, trimmable=self.trimmable, keep=keep):
            if total <= self.max_bytes:
                break
            if remove_own_file(path):
                total -= size
                logger.debug("disk cache evict file=%s bytes=%d", path.name, size)
            self._forget(path.name)

    # -- reports --------------------------------------------------------------------------

    @property
    def num_entries(self) -> int:
        """This model's files on disk now (another process may have added or removed some)."""
        self.refresh()
        with self._lock:
            return len(self._records)

    @property
    def nbytes(self) -> int:
        """Bytes of this model's files on disk now."""
        self.refresh()
        with self._lock:
            return sum(record.nbytes for record in self._records.values())

    def _forget(self, name: str) -> None:
        with self._lock:
            self._records.pop(name, None)

    def _discard(self, path: Path, why: Exception) -> None:
        """Forgets a file that must not be loaded; removes it if this tier wrote it, else
        leaves it where it is (one warning per file)."""
        self._forget(path.name)
        if isinstance(why, BadFile) and not why.ours:
            if path.name not in self._strangers:
                self._strangers.add(path.name)
                logger.warning(
                    "disk cache: ignoring %s (%s): not a file this cache wrote; left in place",
                    path,
                    why,
                )
            return
        removed = remove_own_file(path)
        logger.warning(
            "disk cache: skipped %s %s: %s",
            "and removed" if removed else "(could not remove)",
            path.name,
            why,
        )


def _why_unwritten(directory: Path, job: _Job, error: Exception) -> str:
    """MLX's write error with its likely cause (a full disk) spelled out."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return str(error)
    needed = sum(a.nbytes for a in job.arrays.values())
    if free < needed + 2**20:
        return f"the disk is full ({free:,} bytes free in {directory}, the entry needs {needed:,})"
    return str(error)
