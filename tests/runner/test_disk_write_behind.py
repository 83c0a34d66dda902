"""Each finished turn is written behind: on disk within seconds without `close()` (a process
that ends with `os._exit` or is killed keeps its finished turns), never holding up the next
request; a conversation keeps one file; a file of an older format or of a model with another
tokenizer or chat template is a warning and a cold prefill."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from mlxkv.models.fingerprint import model_fingerprint
from mlxkv.runner.disk import files as store_files
from tests.runner.test_disk_tier import _chat, _files

# How long to wait for a finished turn's file before failing: the wait ends as the file is
# renamed into place (written whole). The "a couple of seconds" is a speed, not asserted
# here (0.3 s at worst of 15 turns on 2 cores at load 11, 20x the median: a 2 s bound was a
# timing assert that a busier machine can fail).
WRITE_WAIT_S = 60.0
ROOT = Path(__file__).resolve().parents[2]


def _written(runner) -> Path:
    """The file the runner's latest entry ends in (its chain's last block), by name."""
    entry = runner._pool.latest
    key = runner._pool.store.block_keys(entry.tokens, entry.salt)[-1]
    return runner.cache_dir / (key + store_files.SUFFIX)


def _wait_for(path: Path, timeout_s: float = WRITE_WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _next_turn(messages: list[dict]) -> list[dict]:
    return messages + [{"role": "user", "content": "And one more?"}]


@pytest.mark.parametrize("arch", ["llama", "lfm2"])  # blocks; whole entries with checkpoints
def test_a_runner_never_closed_has_each_turn_on_disk_and_one_file_per_conversation(
    make_runner, tmp_path, arch
):
    runner = make_runner(arch, cache_entries=4, cache_dir=tmp_path)
    messages, _ = _chat(runner, 3)
    assert _wait_for(_written(runner))
    runner._pool.store.flush()  # the earlier turns' files are removed once it is written
    assert _files(tmp_path) == [_written(runner)]
    reference = make_runner(arch)
    _chat(reference, 3)
    want = reference.generate(_next_turn(messages), max_tokens=6)
    # a second process would see what this one sees: the runner is never closed
    fresh = make_runner(arch, cache_entries=4, cache_dir=tmp_path)
    got = fresh.generate(_next_turn(messages), max_tokens=6)
    assert got.tokens == want.tokens
    assert got.cached_tokens == want.cached_tokens > 0


def test_a_script_ending_with_os_exit_is_reused_by_the_next_process(
    make_runner, loaded_tiny, tmp_path
):
    script = textwrap.dedent(
        f"""
        import json, os, time
        from mlxkv import Runner
        from tests.runner.test_disk_tier import _chat
        from tests.runner.test_disk_write_behind import _wait_for, _written

        runner = Runner.load({str(loaded_tiny("llama").path)!r}, cache_entries=2,
                             cache_dir={str(tmp_path)!r})
        messages, _ = _chat(runner, 2)
        durable = _wait_for(_written(runner))  # no close(), no flush: written behind
        print(json.dumps({{"messages": messages, "durable": durable}}), flush=True)
        os._exit(0)
        """
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
        timeout=120, check=True,
    )  # fmt: skip
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["durable"], done.stderr
    follow_up = _next_turn(result["messages"])
    got = make_runner("llama", cache_entries=2, cache_dir=tmp_path).generate(
        follow_up, max_tokens=6
    )
    reference = make_runner("llama")
    _chat(reference, 2)
    want = reference.generate(follow_up, max_tokens=6)
    assert got.tokens == want.tokens
    assert got.cached_tokens == want.cached_tokens > 0


def test_a_write_in_flight_never_holds_up_the_next_request(make_runner, tmp_path, held_writes):
    release, started = held_writes
    runner = make_runner("llama", cache_entries=2, cache_dir=tmp_path)
    messages, _ = _chat(runner, 1)  # its write starts and is held
    more, outs = _chat(runner, 2, start=messages)  # served while that write is held
    assert started and len(outs) == 2 and not _files(tmp_path)
    release.set()
    runner._pool.store.flush()
    assert _files(tmp_path) == [_written(runner)]
    fresh = make_runner("llama", cache_entries=2, cache_dir=tmp_path)
    assert fresh.generate(_next_turn(more), max_tokens=3).cached_tokens > 0


def test_a_file_of_the_old_format_is_a_warning_and_a_cold_prefill(make_runner, tmp_path, caplog):
    runner = make_runner("llama", cache_entries=2, cache_dir=tmp_path)
    messages, _ = _chat(runner, 1)
    runner.close()
    (path,) = _files(tmp_path)
    old = store_files.FORMAT.encode()
    path.write_bytes(path.read_bytes().replace(old, b"mlxkv-kv-1", 1))
    follow_up = _next_turn(messages)
    with caplog.at_level(logging.WARNING, logger="mlxkv"):
        out = make_runner("llama", cache_entries=2, cache_dir=tmp_path).generate(
            follow_up, max_tokens=3
        )
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "another version" in warnings[0], warnings
    assert out.cached_tokens == 0 and not path.exists()
    assert out.tokens == make_runner("llama").generate(follow_up, max_tokens=3).tokens


def test_the_fingerprint_covers_the_tokenizer_and_the_chat_template(loaded_tiny):
    loaded = loaded_tiny("llama")
    tokenizer = loaded.tokenizer
    same = SimpleNamespace(vocab=tokenizer.vocab, chat_template=tokenizer.chat_template)
    template = SimpleNamespace(vocab=tokenizer.vocab, chat_template=tokenizer.chat_template + " ")
    vocab = SimpleNamespace(
        vocab={**tokenizer.vocab, "<added>": len(tokenizer.vocab)},
        chat_template=tokenizer.chat_template,
    )
    fingerprint = model_fingerprint(loaded)

    def with_tokenizer(other) -> str:
        return model_fingerprint(dataclasses.replace(loaded, tokenizer=other))

    assert with_tokenizer(same) == fingerprint
    assert with_tokenizer(template) != fingerprint
    assert with_tokenizer(vocab) != fingerprint
