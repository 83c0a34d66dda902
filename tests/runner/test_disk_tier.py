"""The disk tier: evicted entries come back from disk, a restart continues a conversation with
the same cached tokens and answer, and no bad file is ever loaded."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest

from mlxkv.runner.disk import files as store_files
from mlxkv.runner.disk import store as store_module

SYSTEM = "You are a helpful assistant. Answer briefly and name one river and one museum."


def _chat(runner, turns: int, start=None, max_tokens: int = 5):
    messages = list(start or [{"role": "system", "content": SYSTEM}])
    outs = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn}: a capital in Europe?"})
        out = runner.generate(messages, max_tokens=max_tokens)
        outs.append(out)
        messages.append({"role": "assistant", "content": out.text})
    return messages, outs


def _files(root: Path) -> list[Path]:
    return sorted(root.glob(f"*/*{store_module.SUFFIX}"))


@pytest.mark.parametrize("arch", ["llama", "lfm2"])
def test_a_restart_continues_with_the_same_cached_tokens_and_answer(make_runner, tmp_path, arch):
    before = make_runner(arch, cache_entries=4, cache_dir=tmp_path)
    messages, _ = _chat(before, 2)
    next_turn = messages + [{"role": "user", "content": "And one more?"}]
    reference = make_runner(arch)  # never restarted: the same requests, in memory
    _chat(reference, 2)
    want = reference.generate(next_turn, max_tokens=6)
    before.close()
    assert _files(tmp_path)

    after = make_runner(arch, cache_entries=4, cache_dir=tmp_path)
    got = after.generate(next_turn, max_tokens=6)
    assert got.tokens == want.tokens
    assert got.cached_tokens == want.cached_tokens > 0


def test_an_evicted_conversation_comes_back_from_disk(make_runner, tmp_path, caplog):
    runner = make_runner("llama", cache_entries=1, cache_dir=tmp_path)
    first, _ = _chat(runner, 1)
    _chat(runner, 1, start=[{"role": "system", "content": "Another assistant entirely."}])
    runner._pool.store.flush()  # the eviction was written in the background
    follow_up = first + [{"role": "user", "content": "Why?"}]
    with caplog.at_level(logging.INFO, logger="mlxkv"):
        out = runner.generate(follow_up, max_tokens=5)
    assert any("disk cache: loaded" in r.getMessage() for r in caplog.records)
    prompt_before_reply = runner.tokenizer.apply_chat_template(
        first[:-1], add_generation_prompt=False
    )
    assert out.cached_tokens >= len(prompt_before_reply)
    assert out.tokens == make_runner("llama").generate(follow_up, max_tokens=5).tokens
    assert runner.cache_info().disk_entries >= 1


def test_the_disk_budget_holds(make_runner, tmp_path):
    probe = make_runner("llama", cache_entries=1, cache_dir=tmp_path / "probe")
    _chat(probe, 1)
    probe.close()
    one_file = _files(tmp_path / "probe")[0].stat().st_size
    budget = int(one_file * 2.5)
    runner = make_runner(
        "llama", cache_entries=1, cache_dir=tmp_path / "kv", cache_dir_bytes=budget
    )
    for i in range(6):
        _chat(runner, 1, start=[{"role": "system", "content": f"Assistant number {i}."}])
    runner.close()
    sizes = [f.stat().st_size for f in _files(tmp_path / "kv")]
    assert len(sizes) >= 2 and sum(sizes) <= budget


def _damage_truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def _damage_flip_data(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-50] ^= 0xFF
    path.write_bytes(bytes(data))


def _damage_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[12:20] = b"!!!!!!!!"
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_damage_truncate, _damage_flip_data, _damage_header])
def test_damaged_files_are_skipped_with_one_warning(make_runner, tmp_path, damage, caplog):
    runner = make_runner("llama", cache_entries=2, cache_dir=tmp_path)
    messages, _ = _chat(runner, 1)
    runner.close()
    (path,) = _files(tmp_path)
    damage(path)
    follow_up = messages + [{"role": "user", "content": "Why?"}]
    with caplog.at_level(logging.WARNING, logger="mlxkv"):
        restarted = make_runner("llama", cache_entries=2, cache_dir=tmp_path)
        out = restarted.generate(follow_up, max_tokens=5)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and path.name in warnings[0], warnings
    assert out.cached_tokens == 0
    assert out.tokens == make_runner("llama").generate(follow_up, max_tokens=5).tokens
    # removed when its header proves this tier wrote it; an unreadable header proves nothing
    assert path.exists() == (damage is _damage_header)


def test_a_file_of_another_model_is_never_loaded(make_runner, tmp_path, caplog):
    llama = make_runner("llama", cache_entries=2, cache_dir=tmp_path)
    messages, _ = _chat(llama, 1)
    llama.close()
    qwen = make_runner("qwen3", cache_entries=2, cache_dir=tmp_path)
    (llama_file,) = _files(tmp_path)
    planted = qwen._pool.store.directory / llama_file.name
    planted.write_bytes(llama_file.read_bytes())
    with caplog.at_level(logging.WARNING, logger="mlxkv"):
        out = qwen.generate(messages + [{"role": "user", "content": "Why?"}], max_tokens=3)
    assert out.cached_tokens == 0
    assert not planted.exists() and llama_file.exists()
    assert any("another model" in r.getMessage() for r in caplog.records)


def test_keyboard_interrupt_during_a_write_leaves_no_file_that_loads(
    make_runner, tmp_path, monkeypatch
):
    runner = make_runner("llama", cache_entries=2, cache_dir=tmp_path)
    real_save = mx.save_safetensors

    def failing(path, arrays, metadata):  # the turn's write behind fails: saved at close
        raise RuntimeError("[save_safetensors] Unable to write 100 bytes")

    monkeypatch.setattr(mx, "save_safetensors", failing)
    messages, _ = _chat(runner, 1)
    runner._pool.store.flush()

    halves = []  # what the interrupted write left

    def interrupted(path, arrays, metadata):
        real_save(path, arrays, metadata)
        halves.append(Path(path).read_bytes()[: os.path.getsize(path) // 2])
        Path(path).write_bytes(halves[-1])
        raise KeyboardInterrupt

    monkeypatch.setattr(mx, "save_safetensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        runner.close()
    monkeypatch.undo()
    assert list(tmp_path.rglob("*.safetensors")) == []
    # a process killed mid-write leaves its temporary file: never indexed, removed once its
    # process is gone (at once when it was of this pid space; another space's, an hour on)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    directory = runner._pool.store.directory
    here, elsewhere = store_files.pid_space(), "0" * 8
    leftover = directory / f".tmp-{int(dead.stdout)}-{here}-{'ab' * 16}{store_module.SUFFIX}"
    leftover.write_bytes(halves[0])  # its header says whose it is
    young = directory / f".tmp-{int(dead.stdout)}-{elsewhere}-{'cd' * 16}{store_module.SUFFIX}"
    young.write_bytes(b"being written, maybe by another container whose pids differ")
    restarted = make_runner("llama", cache_entries=2, cache_dir=tmp_path)
    out = restarted.generate(messages + [{"role": "user", "content": "Why?"}], max_tokens=3)
    assert out.cached_tokens == 0 and not leftover.exists() and young.exists()
    young.unlink()
    restarted._pool.store.flush()  # its own turn, written behind
    before = set(_files(tmp_path))
    runner.close()  # the interrupted write, done again, works
    assert len(set(_files(tmp_path)) - before) == 1


def test_another_process_sharing_the_directory(make_runner, loaded_tiny, tmp_path):
    """A runner picks up a file another process wrote after it started, and the two write the
    same entry without corrupting it."""
    here = make_runner("llama", cache_entries=2, cache_dir=tmp_path)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello?"}]
    script = textwrap.dedent(
        f"""
        from mlxkv import Runner
        with Runner.load({str(loaded_tiny("llama").path)!r}, cache_entries=2,
                         cache_dir={str(tmp_path)!r}) as runner:
            runner.generate({messages!r}, max_tokens=3)
        """
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]))
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=120)
    out = here.generate(messages, max_tokens=3)
    assert out.cached_tokens == len(here.encode(messages)) - 1  # from the other process's file
    here.close()  # the same entry again: same name, replaced atomically
    restarted = make_runner("llama", cache_entries=2, cache_dir=tmp_path)
    again = restarted.generate(messages, max_tokens=3)
    assert again.cached_tokens > 0 and again.tokens == out.tokens
