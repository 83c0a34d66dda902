"""The disk tier among other people's files and under faults: it removes only what it wrote,
keeps a valid file through a transient error, catches a corrupted header, never blocks on a
pipe, serves without the tier where it cannot write, says why a write failed, and reports
what is on disk."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx

from mlxkv.runner.disk import reading as reading_module
from mlxkv.runner.disk.replies import REPLY_SUFFIX
from tests.factories import joined
from tests.runner.test_disk_tier import SYSTEM, _chat, _files


def _one_file_bytes(make_runner, tmp_path) -> int:
    probe = make_runner("llama", cache_entries=1, cache_dir=tmp_path / "probe")
    _chat(probe, 1)
    probe.close()
    return _files(tmp_path / "probe")[0].stat().st_size


def test_over_budget_only_files_this_tier_wrote_are_removed(make_runner, tmp_path):
    budget = int(_one_file_bytes(make_runner, tmp_path) * 1.5)
    root = tmp_path / "kv"
    runner = make_runner("llama", cache_entries=1, cache_dir=root, cache_dir_bytes=budget)
    directory = runner._pool.store.directory
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"precious" * 1000)
    strangers = [
        root / "weights" / "model.safetensors",  # a model next to the cache
        directory / "model.safetensors",  # not a name this tier gives
        directory / f"{'cd' * 16}.safetensors",  # its naming, but not its header
        root / f"{'ef' * 8}" / f"{'01' * 16}.safetensors",  # ditto, in a model folder
        directory / f".tmp-{os.getppid()}-{'ab' * 16}.safetensors",  # a live writer's
    ]
    for path in strangers:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"not mine" * 10_000)
        os.utime(path, (0, 0))  # the oldest files of all: first in line if they counted
    link = directory / f"{'23' * 16}.safetensors"
    link.symlink_to(outside)
    for i in range(4):
        _chat(runner, 1, start=[{"role": "system", "content": f"Assistant number {i}."}])
    runner.close()
    assert [path for path in strangers if not path.exists()] == []
    assert link.is_symlink() and outside.read_bytes() == b"precious" * 1000
    mine = _files(root)
    assert len([p for p in mine if p not in strangers and p != link]) >= 1
    assert sum(p.stat().st_size for p in mine if p not in strangers and p != link) <= budget


def test_a_transient_read_error_keeps_the_file(make_runner, tmp_path, monkeypatch, caplog):
    runner = make_runner("llama", cache_entries=2, cache_dir=tmp_path)
    messages, _ = _chat(runner, 1)
    runner.close()
    (path,) = _files(tmp_path)
    (record,) = runner._pool.store._records.values()
    follow_up = messages + [{"role": "user", "content": "Why?"}]

    def out_of_descriptors(*_args):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(reading_module, "check_sections", out_of_descriptors)
    restarted = make_runner("llama", cache_entries=2, cache_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger="mlxkv"):
        out = restarted.generate(follow_up, max_tokens=3)
    assert out.cached_tokens == 0
    # kept (or replaced by this turn's file, written behind, which holds its tokens too)
    restarted._pool.store.flush()
    held = record.tokens.tolist()
    assert restarted.stored_prefix_tokens(held) == len(held)
    assert any("file is kept" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()
    again = make_runner("llama", cache_entries=2, cache_dir=tmp_path)
    assert again.generate(follow_up, max_tokens=3).cached_tokens > 0


def test_a_corrupted_header_value_is_caught_by_the_checksum(make_runner, tmp_path, caplog):
    runner = make_runner("llama", cache_entries=2, cache_dir=tmp_path)
    messages, _ = _chat(runner, 1)
    runner.close()
    (path,) = _files(tmp_path)
    data = path.read_bytes()
    assert b'\\"meta\\": [\\"256\\"]' in data  # the layer's step, inside the JSON header
    path.write_bytes(data.replace(b'[\\"256\\"]', b'[\\"000\\"]', 1))  # valid, and wrong
    follow_up = messages + [{"role": "user", "content": "Why?"}]
    with caplog.at_level(logging.WARNING, logger="mlxkv"):
        restarted = make_runner("llama", cache_entries=2, cache_dir=tmp_path)
        out = restarted.generate(follow_up, max_tokens=3)
    assert out.cached_tokens == 0 and not path.exists()
    assert any("checksum" in r.getMessage() for r in caplog.records)
    assert out.tokens == make_runner("llama").generate(follow_up, max_tokens=3).tokens


def test_a_named_pipe_in_the_cache_directory_blocks_nothing(make_runner, tmp_path):
    first = make_runner("llama", cache_entries=2, cache_dir=tmp_path)
    directory = first._pool.store.directory
    first.close()
    os.mkfifo(directory / f"{'45' * 16}.safetensors")
    os.mkfifo(tmp_path / f"{'67' * 8}")  # a pipe where a model folder would be
    runner = make_runner("llama", cache_entries=1, cache_dir=tmp_path, cache_dir_bytes=1)
    _chat(runner, 2)  # evictions and a budget of one byte: every file is a candidate
    runner.close()
    assert (directory / f"{'45' * 16}.safetensors").exists()


def test_a_directory_that_cannot_be_written_leaves_the_tier_off(make_runner, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="mlxkv"):
        runner = make_runner("llama", cache_entries=1, cache_dir=blocker / "kv")
    assert any("disk tier off" in r.getMessage() for r in caplog.records)
    _chat(runner, 2)
    runner.close()
    assert runner.cache_info().disk_budget_bytes is None


def test_a_file_that_cannot_be_removed_is_skipped_not_fatal(
    make_runner, tmp_path, monkeypatch, caplog
):
    runner = make_runner("llama", cache_entries=2, cache_dir=tmp_path)
    messages, _ = _chat(runner, 1)
    runner.close()
    (path,) = _files(tmp_path)
    path.write_bytes(path.read_bytes()[:-10])  # truncated, in a directory that is read-only:
    real_unlink = Path.unlink

    def read_only(self, missing_ok=False):
        if self == path:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", read_only)
    with caplog.at_level(logging.WARNING, logger="mlxkv"):
        restarted = make_runner("llama", cache_entries=2, cache_dir=tmp_path)
        out = restarted.generate(messages + [{"role": "user", "content": "Why?"}], max_tokens=3)
    assert out.cached_tokens == 0 and path.exists()
    assert any("could not remove" in r.getMessage() for r in caplog.records)


def _full_disk_save(path, arrays, metadata):
    """MLX's save on a full disk: part of the temporary file written, then its error."""
    Path(path).write_bytes(b"partial")
    raise RuntimeError("[save_safetensors] Unable to write 4096 bytes.")


def test_a_full_disk_is_one_line_per_write_and_a_cold_prefill(
    make_runner, tmp_path, monkeypatch, caplog
):
    runner = make_runner("llama", cache_entries=2, cache_dir=tmp_path)
    monkeypatch.setattr(mx, "save_safetensors", _full_disk_save)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: SimpleNamespace(free=10))
    with caplog.at_level(logging.WARNING, logger="mlxkv"):
        messages, _ = _chat(runner, 1)  # its turn, written behind, fails
        runner._pool.store.flush()
        runner.close()  # the same entry again: no exception
    # A Runner an earlier test dropped may still be writing behind (its finalizer does not
    # wait), into its own directory, through the same patched save: not this Runner's lines.
    lines = [
        r
        for r in caplog.records
        if r.levelno >= logging.WARNING
        and not ("bytes free in" in r.getMessage() and str(tmp_path) not in r.getMessage())
    ]
    # the turn's block, its reply's record (`disk.replies`) and the block again at close()
    assert len(lines) == 3, [r.getMessage() for r in lines]
    assert all("the disk is full (10 bytes free" in r.getMessage() for r in lines)
    assert all(r.exc_info is None for r in lines)
    assert _files(tmp_path) == []
    monkeypatch.undo()
    follow_up = messages + [{"role": "user", "content": "Why?"}]
    restarted = make_runner("llama", cache_entries=2, cache_dir=tmp_path)
    out = restarted.generate(follow_up, max_tokens=3)
    assert out.cached_tokens == 0
    assert out.tokens == make_runner("llama").generate(follow_up, max_tokens=3).tokens


def test_a_full_disk_says_what_is_free_once_the_failed_write_is_removed(
    make_runner, tmp_path, monkeypatch, caplog
):
    """The partial temporary file took what was free: measured while it was still there,
    the warning said "0 bytes free" whatever the disk held before the write."""
    runner = make_runner("llama", cache_entries=2, cache_dir=tmp_path)
    directory = runner._pool.store.directory

    def usage(_):
        return SimpleNamespace(free=0 if list(directory.glob(".tmp-*")) else 5000)

    monkeypatch.setattr(mx, "save_safetensors", _full_disk_save)
    monkeypatch.setattr(shutil, "disk_usage", usage)
    with caplog.at_level(logging.WARNING, logger="mlxkv.runner.disk"):
        _chat(runner, 1)
        runner._pool.store.flush()
    lines = [r.getMessage() for r in caplog.records if str(directory) in r.getMessage()]
    assert lines and all("the disk is full (5,000 bytes free in" in line for line in lines)
    runner.close()


def test_the_report_is_what_is_on_disk(make_runner, tmp_path):
    runner = make_runner("llama", cache_entries=1, cache_dir=tmp_path)
    for i in range(3):
        _chat(runner, 1, start=[{"role": "system", "content": f"{SYSTEM} Number {i}."}])
    runner._pool.store.flush()
    files = _files(tmp_path)
    replies = sorted(tmp_path.glob(f"*/*{REPLY_SUFFIX}"))  # written beside the blocks
    info = runner.cache_info()
    assert info.disk_entries == len(files) >= 2 and len(replies) >= 1
    assert info.disk_bytes == sum(p.stat().st_size for p in [*files, *replies])
    files[0].unlink()  # another server sharing the directory evicted it
    info = runner.cache_info()
    assert info.disk_entries == len(files) - 1
    assert info.disk_bytes == sum(p.stat().st_size for p in [*files[1:], *replies])
    runner.close()


def test_refresh_and_reports_from_two_threads(make_runner, tmp_path):
    """The server's report thread and the engine thread both look at the index."""
    runner = make_runner("llama", cache_entries=1, cache_dir=tmp_path)
    stop = threading.Event()
    errors = []

    def report():
        try:
            for _ in range(200):
                if stop.is_set():
                    return
                runner.cache_info()
        except Exception as error:  # pragma: no cover - the failure being tested
            errors.append(error)

    thread = threading.Thread(target=report)
    thread.start()
    for i in range(3):
        _chat(runner, 1, start=[{"role": "system", "content": f"Assistant {i}."}])
    stop.set()
    joined(thread)
    runner.close()
    assert not errors
