"""The disk tier: cache entries as chains of safetensors blocks in a directory with its own
byte budget (a prefix conversations share is one chain of blocks, stored once).

Owns: the index of blocks, which entries go to the writer, loading a chain back into a
ModelCache, and the directory's budget. Does not own the file format (`files`), chains
(`chains`), cutting an entry into write jobs (`jobs`), the writer thread (`writer`), which
files count against the budget and go first (`budget`), what a file that fails a check leaves
(`bad_files`), or which entry goes to disk or when a load pays (see `pool`).

Invariants:
  - only files this tier wrote are ever removed: regular files named as it names them, whose
    header says they are an mlxkv file; anything else is left alone, not counted in the budget;
  - a file is never loaded unless its header parses, its fingerprint and signature match, its
    size is what the header says, its arrays are those its layout names in the shapes its
    token ids say (`blocks.check_block`) and its CRCs match; else it is removed, with one
    warning (an error that proves nothing about the file, out of memory, keeps it: a prefill);
  - a file appears under its final name only complete (temporary name, CRCs patched in,
    fsync, atomic rename, directory fsync): an interrupted write leaves at most a temporary
    file, which indexing ignores, the budget counts, and a scan removes once its writer is gone;
  - a block is removed once a newer one beside it holds its tokens and serves them (a
    conversation written behind turn after turn keeps one chain), with the blocks after it,
    last first (a process killed between two removals leaves a shorter chain, never a
    block without its parent), but for a block a queued write follows, and those before it;
  - a block is written only while its parent is indexed or queued (a removal between a
    request's check and its put leaves the blocks after it unwritten, not orphaned), and is
    indexed only while its parent is on disk or queued (checked after its rename: another
    process's budget may have taken the parent meanwhile); one job runs at a time, the
    writer's or a close's (`_run_logged`);
  - two processes sharing the directory write identical content under identical names, and
    each picks up the other's new files when the directory changes;
  - a scan of the directory and this process's own renames and removals (each with its index
    change) exclude each other, so the index never drops a file written while a scan ran;
  - a scan removes the blocks whose parent is gone (`_remove_broken`): a process sees
    another's files at its scans only, so it may remove a parent of a block it has not seen.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from pathlib import Path

import numpy as np

from mlxkv.cache.model_cache import ModelCache
from mlxkv.cache.serialize import ArrayShapes
from mlxkv.runner.disk.bad_files import BadFiles, remove_orphaned_temporaries
from mlxkv.runner.disk.budget import removal_order, temporary_bytes, tier_files
from mlxkv.runner.disk.chains import (
    BLOCK_TOKENS,
    StoredChain,
    block_ranges,
    broken,
    longest_chain,
    superseded_by,
)
from mlxkv.runner.disk.files import (
    SUFFIX,
    BadFile,
    StoredEntry,
    check_writable,
    model_directories,
    own_files,
    read_record,
    remove_own_file,
    token_key,
)
from mlxkv.runner.disk.jobs import block_jobs
from mlxkv.runner.disk.replies import REPLY_SUFFIX, ReplyRecords, StoredReply
from mlxkv.runner.disk.restore import restore_chain
from mlxkv.runner.disk.writer import BackgroundWriter, PendingWrites, WriteJob, write_file

logger = logging.getLogger(__name__)

# A first guess at disk read speed, replaced by measurement after the first load.
DEFAULT_READ_BYTES_PER_S = 500 * 2**20


class DiskStore:
    """Cache entries on disk, indexed by their token ids.

    Args:
        root: the cache directory (shared by models; each gets a subdirectory).
        fingerprint: identifies the model's config and weights (hex).
        signature: the cache layout (`serialize.layout_signature`).
        max_bytes: most bytes all files under `root` may take; the oldest go first.
        trimmable: every layer can trim, so a chain serves any prefix of its tokens (else
            only the lengths its blocks hold every layer's state at: `blocks.stops`).
        kv_bits: float K/V written quantized to this many bits (`blocks.cut_block`); None
            as computed. Files are loaded whatever theirs.
    """

    def __init__(
        self,
        root: Path,
        *,
        fingerprint: str,
        signature: str,
        max_bytes: int,
        trimmable: bool,
        kv_bits: int | None = None,
    ):
        self.root = Path(root)
        key = hashlib.sha256(f"{fingerprint}\n{signature}".encode()).hexdigest()[:16]
        self.directory = self.root / key
        check_writable(self.directory)
        self.fingerprint = fingerprint
        self.signature = signature
        self.max_bytes = max_bytes
        self.trimmable = trimmable
        self.kv_bits = kv_bits
        self.block_tokens = BLOCK_TOKENS  # read here, so a test may set smaller blocks
        self.read_bytes_per_s = float(DEFAULT_READ_BYTES_PER_S)
        self.streamed = True  # a load's layers used as checked (False: files checked whole)
        # tokens between the state layers' disk snapshots (`snapshots`); None: none taken
        self.snapshot_every_tokens: int | None = None
        # the memory budget the writes queued may reach before another is skipped (a disk
        # slower than the requests would otherwise queue copies of K/V without bound)
        self.max_pending_bytes: int | None = None
        self.model_shapes: ArrayShapes | None = None  # what a restore's arrays are held to
        self._records: dict[str, StoredEntry] = {}
        self._lock = threading.Lock()  # guards _records
        # held while a scan compares the directory with the index, and while this process
        # adds or removes a file and its record: a scan never sees one without the other
        self._directory_lock = threading.RLock()
        self._bad = BadFiles(self._forget, self._directory_lock)  # files that must not load
        self._writer = BackgroundWriter(self._run_logged)
        self._job_lock = threading.Lock()  # one job at a time: the writer's, or a close's
        self._scanned_mtime = -1
        # other models' files proven this tier's, by (path, size, mtime): read once
        self._theirs: dict[tuple[str, int, int], bool] = {}
        self.replies = ReplyRecords(self.directory, fingerprint, signature)
        self.refresh()  # the blocks and the reply records on disk
        self.enforce_budget()  # a smaller budget than the last run's holds from the start

    # -- index ----------------------------------------------------------------------------

    def refresh(self) -> None:
        """Indexes files added since the last scan (by any process) and forgets those removed;
        removes bad ones and temporary files left by processes that are gone."""
        with self._directory_lock:
            self._rescan()

    def _rescan(self) -> None:
        mtime = self.directory.stat().st_mtime_ns
        if mtime == self._scanned_mtime:
            return
        # records first: one listed has its blocks (written before it) listed after it
        self.replies.rescan()
        complete, present = True, set()
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
                self._bad.discard(path, why)
                continue
            except OSError as error:  # transient (or removed meanwhile): look again next time
                complete = complete and isinstance(error, FileNotFoundError)
                continue
            with self._lock:
                self._records[path.name] = record
        remove_orphaned_temporaries(self.directory)
        with self._lock:
            for name in set(self._records) - present - self._writer.queued_names():
                del self._records[name]
        self._remove_broken()
        if complete:
            self._scanned_mtime = mtime

    def _remove_broken(self) -> None:
        """Removes the blocks indexed whose parent is gone (`chains.broken`): another process
        removed it before its scan saw them (its budget, a superseding write), it was corrupt,
        or a process died before removing a block it found without it (`_indexed`)."""
        records = self._indexed_records()
        queued = {name.removesuffix(SUFFIX) for name in self._writer.queued_names()}
        for record in broken(records, lambda key: key in queued or self._on_disk(key)):
            if remove_own_file(record.path):
                logger.debug("disk cache removed file=%s: the block before it is gone", record.key)
            self._forget(record.path.name)

    def best(
        self, tokens: np.ndarray, limit: int, salt: str | None = None, *, rescan: bool = True
    ) -> tuple[StoredChain | None, int]:
        """The chain of `salt`'s blocks that serves the longest prefix of `tokens` (at most
        `limit` tokens), and that length in tokens (0 with None when none serves any). Without
        `rescan`, among the files indexed now: safe from any thread (a scan removes bad files,
        the engine thread's job), for questions that must not change the cache."""
        if rescan:
            self.refresh()
        with self._lock:
            records = [r for r in self._records.values() if r.salt == salt]
        return longest_chain(records, tokens[:limit], trimmable=self.trimmable)

    def block_keys(self, tokens: np.ndarray, salt: str | None = None) -> list[str]:
        """The keys of the blocks that hold `tokens` in `salt`'s domain, first to last."""
        keys: list[str] = []
        for start, end in block_ranges(tokens.size, self.block_tokens):
            keys.append(token_key(tokens[start:end], salt, keys[-1] if keys else None))
        return keys

    def holds(self, tokens: np.ndarray, salt: str | None = None) -> bool:
        """True when blocks of `salt` hold exactly these tokens (written, indexed or queued
        for writing by this store)."""
        return self._written_or_queued(self.block_keys(tokens, salt)[-1] + SUFFIX)

    def _written_or_queued(self, name: str) -> bool:
        # queued first: a job leaves the queue after its record is indexed
        if self._writer.is_queued(name):
            return True
        with self._lock:
            return name in self._records

    # -- load -----------------------------------------------------------------------------

    def load(
        self, chain: StoredChain, empty: ModelCache, *, streamed: bool | None = None
    ) -> ModelCache | None:
        """Fills `empty` with the first `chain.num_tokens` tokens from `chain`'s files, or the
        longest prefix its readable blocks restore (`restore.restore_chain`; the request
        prefills the rest): None when they restore none. `streamed` (None: the store's): a
        layer that fails its checks once used breaks the restore (`RestoreBroken`;
        `prompt_cache.restore_again`)."""
        streamed = self.streamed if streamed is None else streamed
        return restore_chain(
            chain,
            empty,
            trimmable=self.trimmable,
            streamed=streamed,
            reject=self._bad.reject,
            discard=self._bad.discard,
            measured=self._measured,
            model_shapes=self.model_shapes,
        )

    def _measured(self, nbytes: int, seconds: float) -> None:
        """A load of `nbytes` took `seconds` (streamed: its checks): `cheapest_restore`'s rate."""
        self.read_bytes_per_s = nbytes / max(seconds, 1e-6)

    # -- write ----------------------------------------------------------------------------

    def write(
        self,
        cache: ModelCache,
        *,
        wait: bool = False,
        salt: str | None = None,
        reply_start: int | None = None,
    ) -> None:
        """Saves `cache` under its token ids, as the blocks not on disk yet: in the background
        (each block's arrays stay referenced, and count in `pending_writes`, until written), or
        now with `wait`. An entry already on disk, empty, larger than the budget or of a layer
        type that cannot be saved is skipped. `salt`: the isolation domain the entry belongs
        to. `reply_start`: where its last request's reply began (None: its end); a later
        file of its conversation that holds the tokens before it supersedes it. The cache's
        disk snapshots (`snapshot_for_disk`) go with the blocks they fall in; it forgets them.
        Skipped in the background while the writes queued hold over `max_pending_bytes`."""
        cache.pass_gate()  # a streamed restore's layers are written only once checked
        snapshots = cache.take_disk_snapshots()  # held by the jobs of the blocks they fall in
        tokens = np.asarray(cache.tokens, dtype=np.uint32)
        if tokens.size == 0:
            return
        keys = self.block_keys(tokens, salt)
        last = keys[-1] + SUFFIX
        if self._written_or_queued(last):
            return  # its last block is written or queued: so are the blocks before it
        if not wait and self.pending_writes.over(self.max_pending_bytes):
            return  # its disk snapshots go with it: they were kept for this write only
        jobs = block_jobs(
            cache,
            snapshots,
            tokens,
            keys,
            fingerprint=self.fingerprint,
            signature=self.signature,
            salt=salt,
            reply_start=tokens.size if reply_start is None else reply_start,
            block_tokens=self.block_tokens,
            kv_bits=self.kv_bits,
            max_bytes=self.max_bytes,
            written=self._written_or_queued,
        )
        for job in jobs:
            self._run_logged(job) if wait else self._writer.put(job)

    def write_reply(
        self, prompt: list[int], ids: list[int], text: str, salt: str | None, context: str
    ) -> None:
        """Saves, behind the blocks queued before it, the record of reply `ids` (`text`) to
        `prompt` (its `context`, `text.replies.reply_context`) in `salt`'s domain
        (`replies`), so a restart renders the reply as those ids."""
        through = np.asarray([*prompt, *ids[:-1]], dtype=np.uint32)
        job = self.replies.job(through, ids, (text, salt, context), self.block_tokens)
        self._writer.put(job)

    def stored_replies(self, limit: int) -> list[StoredReply]:
        """The newest `limit` reply records whose blocks are on disk; those whose blocks are
        gone are removed (`ReplyRecords.sweep`)."""
        self.refresh()
        self._sweep_replies()
        return self.replies.newest(limit)

    def _sweep_replies(self) -> None:
        """Removes the reply records whose blocks are gone (`ReplyRecords.sweep`), not beside
        a scan (on another thread) that has indexed a record but not yet its blocks."""
        with self._directory_lock:
            records = self._indexed_records()
            self.replies.sweep(records)

    def stored_reply(self, salt: str | None, text: str) -> dict[str | None, list[int]] | None:
        """The ids of `text`'s reply records in `salt`'s domain by their contexts, written or
        queued (`ReplyRecords.ids_of`; `ReplyTokens.known_in` asks for a reply it dropped)."""
        return self.replies.ids_of(salt, text, self._writer.queued_jobs())

    @property
    def pending_writes(self) -> PendingWrites:  # handed to the writer, not written yet
        return self._writer.pending

    def flush(self) -> None:  # waits until every background write has finished
        self._writer.flush()

    def close(self, wait: bool = True) -> None:
        """Finishes pending writes and stops the writer thread; with `wait`, returns when
        it has (`BackgroundWriter.close`)."""
        self._writer.close(wait)

    def _run_logged(self, job: WriteJob) -> None:
        """`_run`, a failure logged in one line: a failed write loses a cache entry, never
        the process (nor a shutdown)."""
        try:
            with self._job_lock:
                self._run(job)
        except (OSError, RuntimeError) as error:
            logger.warning("disk cache: entry %s not saved: %s", job.name, error)
        except Exception:
            logger.exception("disk cache: writing %s failed", job.name)

    def _run(self, job: WriteJob) -> None:
        start = time.perf_counter()
        if job.name.endswith(REPLY_SUFFIX):  # a reply record: not a block of the index
            write_file(self.directory, job, self._directory_lock, self.replies.written)
            self.enforce_budget()  # records count in it too
            return
        parent = job.metadata.get("parent")
        if parent is not None and not self._written_or_queued(parent + SUFFIX):
            record = None  # removed here since the job was put
        else:
            record = write_file(self.directory, job, self._directory_lock, self._indexed)
        if record is None:
            logger.debug("disk cache: %s not saved: the block before it is gone", job.name)
            return
        self._remove_superseded(record)
        for again in self.replies.held_again(record, self._indexed_records()):
            self._writer.put(again)  # behind this block, and its budget check after it
        took_s, size = time.perf_counter() - start, (record.num_tokens, record.nbytes)
        logger.debug("disk cache write tokens=%d bytes=%d seconds=%.3f", *size, took_s)
        self.enforce_budget(keep=record.path)

    def _indexed(self, path: Path) -> StoredEntry | None:
        """The record of a block just renamed in (under the directory lock), as read at start;
        None, the block removed again, when the block before it is neither on disk nor queued:
        another process's budget, which cannot see this one's queue, removed it."""
        record = read_record(path, self.fingerprint, self.signature)
        parent = record.parent
        if parent and not (self._writer.is_queued(parent + SUFFIX) or self._on_disk(parent)):
            remove_own_file(path)
            return None
        with self._lock:
            self._records[path.name] = record
            return record

    def _remove_superseded(self, record: StoredEntry) -> None:
        """Removes the blocks `record` supersedes (`chains.superseded_by`): a conversation
        written behind turn after turn keeps one chain, not one per turn."""
        records = self._indexed_records()
        followed = self._queued_parents()
        for other in superseded_by(record, records, trimmable=self.trimmable, followed=followed):
            with self._directory_lock:
                if remove_own_file(other.path):
                    logger.debug("disk cache superseded file=%s", other.path.name)
                self._forget(other.path.name)

    def _queued_parents(self) -> frozenset[str]:
        """The file names of the blocks that blocks queued for writing (the one in flight
        too) follow: removed, those would be written without the blocks before them."""
        queued = self._writer.queued_jobs()
        return frozenset(j.metadata["parent"] + SUFFIX for j in queued if "parent" in j.metadata)

    # -- budget ---------------------------------------------------------------------------

    def enforce_budget(self, keep: Path | None = None) -> None:
        """Removes this tier's files (of any model under `root`) until they, this model's
        reply records and the temporary files (`temporary_bytes`: never removed here) fit in
        `max_bytes`: files another file supersedes first, then the least recently used (the
        records of the chains removed go with them). Run after each write (docs/disk.md)."""
        with self._lock:
            records = dict(self._records)
        files = tier_files(self.root, self.directory, set(records), self._theirs)
        total = sum(size for _, size, _ in files) + self.replies.nbytes
        total += temporary_bytes(model_directories(self.root), self._theirs)
        if total <= self.max_bytes:
            return  # the order below costs more than this sum
        queued_after = self._queued_parents()
        for path, size, _ in removal_order(
            files, records, trimmable=self.trimmable, keep=keep, queued_after=queued_after
        ):
            if total <= self.max_bytes:
                break
            with self._directory_lock:
                if remove_own_file(path):
                    total -= size
                    logger.debug("disk cache evict file=%s bytes=%d", path.name, size)
                self._forget(path.name)
        self._sweep_replies()  # the records of the chains removed go with them

    # -- reports --------------------------------------------------------------------------

    @property
    def num_entries(self) -> int:  # this model's files on disk now (other processes' too)
        self.refresh()
        with self._lock:
            return len(self._records)

    @property
    def nbytes(self) -> int:
        """Bytes of this model's files on disk now: its blocks, its reply records and its
        temporary files, as the budget counts them (`enforce_budget`)."""
        self.refresh()
        with self._lock:
            blocks = sum(record.nbytes for record in self._records.values())
        return blocks + self.replies.nbytes + temporary_bytes([self.directory], self._theirs)

    def _indexed_records(self) -> list[StoredEntry]:
        with self._lock:
            return list(self._records.values())

    def _on_disk(self, key: str) -> bool:  # whoever wrote it, indexed or not
        return (self.directory / (key + SUFFIX)).exists()

    def _forget(self, name: str) -> None:
        with self._lock:
            self._records.pop(name, None)
