"""The reply memory survives a restart: a reply whose text encodes to other ids than the model
wrote (`test_reply_tokens`), sent back to a new process (or a model loaded again) with the same
disk tier, renders as the ids the disk tier restores, so the next turn reuses the whole earlier
turn, as a process that never restarted does, and answers as a fresh Runner given those ids."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from mlxkv import Runner
from mlxkv.models.loading import load_model
from mlxkv.runner import assembly
from mlxkv.runner.disk import replies as stored_replies
from mlxkv.runner.disk.files import SUFFIX
from mlxkv.runner.request_builder import salt_digest
from mlxkv.runner.text.replies import replies_for, reply_context
from mlxkv.testing.factory import build_scripted_model
from tests.runner.test_reply_tokens import ASK, SCRIPT, _next_turn

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def scripted_path(tmp_path_factory) -> Path:
    return build_scripted_model(tmp_path_factory.mktemp("smol") / "model", SCRIPT)


def _runner(path: Path, cache_dir: Path | None) -> Runner:
    """A Runner of a model loaded afresh: its tokenizer (and so its reply memory) is new, as
    in a restarted process."""
    return Runner(load_model(path), max_context=512, cache_entries=2, cache_dir=cache_dir)


def _turn_one(runner: Runner) -> tuple[str, list[int], list[int]]:
    """Turn 1's reply text, the ids the cache holds after it, and turn 2's prompt as the
    process that generated the reply renders it (its ids in place of its text)."""
    first = runner.generate(ASK, max_tokens=20, temperature=0)
    tokenizer = runner.tokenizer
    assert first.text == "SmolLAMSmolLAM"
    encoded = tokenizer.encode(first.text, add_special_tokens=False)
    assert encoded != first.tokens and len(encoded) < len(first.tokens)  # the case at hand
    return first.text, runner.cache_tokens, runner.encode(_next_turn(first.text))


def _wait_for_records(runner: Runner) -> None:
    runner._pool.store.flush()  # a killed process keeps what its writer finished


def _check_turn_two(scripted_path: Path, cache_dir: Path, text, held, want_ids) -> None:
    restarted = _runner(scripted_path, cache_dir)
    got, got_logprobs = _answer(restarted, _next_turn(text))
    assert got.prompt_tokens == len(want_ids)
    assert got.cached_tokens == len(held)  # the prompt, the reply and its end, from disk
    reference = _runner(scripted_path, None)  # no cache: the model alone, on those ids
    want, want_logprobs = _answer(reference, want_ids)
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got_logprobs, want_logprobs, atol=1e-4)


def _answer(runner: Runner, prompt) -> tuple:
    chunks = list(runner.stream(prompt, max_tokens=4, temperature=0, logprobs=0))
    return chunks[-1].completion, [c.logprob.logprob for c in chunks if c.logprob]


def test_a_reply_sent_back_after_close_is_reused_in_full(scripted_path, tmp_path):
    before = _runner(scripted_path, tmp_path)
    text, held, want_ids = _turn_one(before)
    before.close()
    _check_turn_two(scripted_path, tmp_path, text, held, want_ids)


@pytest.mark.parametrize("end", ["os_exit", "sigkill"])
def test_a_reply_sent_back_after_the_process_ends_unclosed_is_reused_in_full(
    scripted_path, tmp_path, end
):
    """The record is written behind with the turn's blocks: a process that ends without
    close() (`os._exit`, or killed with SIGKILL while it waits) keeps it."""
    script = textwrap.dedent(
        f"""
        import json, os, sys
        from pathlib import Path
        from tests.runner.test_reply_restart import _runner, _turn_one, _wait_for_records

        runner = _runner(Path({str(scripted_path)!r}), Path({str(tmp_path)!r}))
        text, held, want_ids = _turn_one(runner)
        _wait_for_records(runner)  # no close(): the writer's own pace
        print(json.dumps({{"text": text, "held": held, "want_ids": want_ids}}), flush=True)
        if {end!r} == "os_exit":
            os._exit(0)
        sys.stdin.read()  # until killed
        """
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    child = subprocess.Popen(
        [sys.executable, "-c", script], env=env, cwd=ROOT, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = child.stdout.readline()  # its turn done and written
        if end == "sigkill":
            child.send_signal(signal.SIGKILL)
        child.wait(timeout=120)
    finally:
        child.kill()
        child.communicate(timeout=30)
    assert line, "the child printed nothing"
    result = json.loads(line)
    _check_turn_two(scripted_path, tmp_path, result["text"], result["held"], result["want_ids"])


def test_a_reply_of_another_salt_is_not_taken_after_a_restart(scripted_path, tmp_path):
    before = _runner(scripted_path, tmp_path)
    first = before.generate(ASK, max_tokens=20, temperature=0, cache_salt="alice")
    before.close()
    restarted = _runner(scripted_path, tmp_path)
    messages = _next_turn(first.text)
    plain = restarted.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert len(restarted.encode(messages, cache_salt="bob")) == len(plain)
    assert len(restarted.encode(messages)) == len(plain)  # the shared domain is another too
    alice = restarted.encode(messages, cache_salt="alice")
    assert len(alice) == len(plain) + len(first.tokens) - 2


def _records(root: Path) -> list[Path]:
    return sorted(root.glob(f"*/*{stored_replies.REPLY_SUFFIX}"))


@pytest.mark.parametrize("damage", ["flipped", "torn", "foreign"])
def test_a_damaged_record_is_a_warning_and_renders_as_text(scripted_path, tmp_path, caplog, damage):
    """A bit flipped in its reply's ids fails the CRC, another model's fingerprint fails its
    check (either header proves the file this tier's: removed); a torn one has no header to
    prove anything (left in place). Each renders the reply as text, as before records."""
    before = _runner(scripted_path, tmp_path)
    text, _, _ = _turn_one(before)
    before.close()
    (record,) = _records(tmp_path)
    data = bytearray(record.read_bytes())
    if damage == "flipped":
        data[data.index(b'"ids":"') + 8] ^= 0x01  # still base64: other ids, one bit off
    elif damage == "foreign":  # another model's record (its fingerprint), put here
        at = data.index(b'"fingerprint":"') + len(b'"fingerprint":"')
        data[at : at + 8] = b"ffffffff" if data[at : at + 8] != b"ffffffff" else b"00000000"
    else:
        del data[len(data) // 2 :]
    record.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        restarted = _runner(scripted_path, tmp_path)
    assert any(record.name in r.getMessage() for r in caplog.records)
    messages = _next_turn(text)
    plain = restarted.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert len(restarted.encode(messages)) == len(plain)
    assert record.exists() == (damage == "torn")


def test_a_record_goes_with_its_chain_when_the_budget_evicts_it(scripted_path, tmp_path):
    """Two conversations (two salts) in a directory that holds one: the first's blocks are
    evicted as the second's are written, and its reply's record with them."""
    probe = tmp_path / "probe"
    sizing = _runner(scripted_path, probe)
    sizing.generate(ASK, max_tokens=20, temperature=0)
    sizing.close()
    one = sum(p.stat().st_size for p in probe.glob(f"*/*{SUFFIX}"))
    runner = Runner(
        load_model(scripted_path), max_context=512, cache_entries=1,
        cache_dir=tmp_path / "kv", cache_dir_bytes=int(one * 1.5),
    )  # fmt: skip
    names = []
    for salt in ("first", "second"):
        runner.generate(ASK, max_tokens=20, temperature=0, cache_salt=salt)
        runner._pool.store.flush()
        after = reply_context(runner.encode(ASK))
        names.append(stored_replies.reply_name(salt_digest(salt), "SmolLAMSmolLAM", after))
    assert [p.name for p in _records(tmp_path / "kv")] == [names[1]]
    first = _next_turn("SmolLAMSmolLAM")
    plain = runner.tokenizer.apply_chat_template(first, add_generation_prompt=True)
    restarted = _runner(scripted_path, tmp_path / "kv")
    assert len(restarted.encode(first, cache_salt="first")) == len(plain)


def test_a_record_goes_with_its_chain(scripted_path, tmp_path):
    """Records whose conversation's blocks were evicted are removed as the disk tier starts."""
    before = _runner(scripted_path, tmp_path)
    _turn_one(before)
    before.close()
    assert len(_records(tmp_path)) == 1
    for block in tmp_path.glob(f"*/*{SUFFIX}"):
        block.unlink()  # as the budget removes them
    _runner(scripted_path, tmp_path)
    assert _records(tmp_path) == []


def test_the_newest_records_are_remembered_and_the_older_found_on_disk(
    scripted_path, tmp_path, monkeypatch
):
    """As many as the memory keeps (`MAX_REPLIES`), the newest, are read into it at start;
    the older stay on disk (they go with their chains, and count in the budget) and render
    as their ids when sent back, as in the process that wrote them."""
    before = _runner(scripted_path, tmp_path)
    for salt in ("old", "new"):
        before.generate(ASK, max_tokens=20, temperature=0, cache_salt=salt)
        before._pool.store.flush()  # one after the other: their files' times tell which
    before.close()
    after = reply_context(before.encode(ASK))
    old, new = (
        stored_replies.reply_name(salt_digest(s), "SmolLAMSmolLAM", after) for s in ("old", "new")
    )
    assert {p.name for p in _records(tmp_path)} == {old, new}
    monkeypatch.setattr(assembly, "MAX_REPLIES", 1)
    restarted = _runner(scripted_path, tmp_path)
    assert {p.name for p in _records(tmp_path)} == {old, new}
    memory = replies_for(restarted.tokenizer).items()
    assert [(salt, text) for salt, text, _, _ in memory] == [(salt_digest("new"), "SmolLAMSmolLAM")]
    messages = _next_turn("SmolLAMSmolLAM")
    assert restarted.encode(messages, cache_salt="new") == restarted.encode(
        messages, cache_salt="old"
    )


def test_records_count_in_the_directory_budget(scripted_path, tmp_path):
    """A budget that holds a turn's blocks but not its reply's record too: the budget removes
    files until blocks and records together fit (before, records were not counted)."""
    runner = _runner(scripted_path, tmp_path)
    runner.generate(ASK, max_tokens=20, temperature=0)
    store = runner._pool.store
    store.flush()
    blocks = sum(p.stat().st_size for p in tmp_path.glob(f"*/*{SUFFIX}"))
    records = sum(p.stat().st_size for p in _records(tmp_path))
    assert records > 0
    store.max_bytes = blocks + records - 1
    store.enforce_budget()
    on_disk = [*tmp_path.glob(f"*/*{SUFFIX}"), *_records(tmp_path)]
    assert sum(p.stat().st_size for p in on_disk) <= store.max_bytes
    runner.close()
    # and the writer keeps to it by itself: the record, written after the turn's blocks (and
    # their budget check), is checked too (before, it left the directory over until a next
    # block was written)
    again = _runner(scripted_path, tmp_path / "again")
    again._pool.store.max_bytes = blocks + records - 1
    again.generate(ASK, max_tokens=20, temperature=0)
    again._pool.store.flush()
    on_disk = [*(tmp_path / "again").glob(f"*/*{SUFFIX}"), *_records(tmp_path / "again")]
    assert sum(p.stat().st_size for p in on_disk) <= blocks + records - 1
    again.close()


def test_another_models_records_count_in_the_directory_budget(scripted_path, tmp_path, make_runner):
    """Two models share the directory: the budget counted the other model's blocks but not
    its reply records, so the files on disk could be that much over it."""
    other = _runner(scripted_path, tmp_path)
    other.generate(ASK, max_tokens=20, temperature=0)
    other.close()
    assert len(_records(tmp_path)) == 1
    runner = make_runner("llama", cache_entries=2, cache_dir=tmp_path)  # another model
    runner.generate(ASK, max_tokens=4)
    store = runner._pool.store
    store.flush()
    on_disk = [*tmp_path.glob(f"*/*{SUFFIX}"), *_records(tmp_path)]
    store.max_bytes = sum(p.stat().st_size for p in on_disk) - 1
    store.enforce_budget()
    on_disk = [*tmp_path.glob(f"*/*{SUFFIX}"), *_records(tmp_path)]
    assert sum(p.stat().st_size for p in on_disk) <= store.max_bytes
    runner.close()


def test_records_another_process_writes_count_in_the_budget(scripted_path, tmp_path):
    """Two servers of one model share the directory: each counted only the records it wrote
    or read at its start, so the other's later records were left out of `disk_bytes` and of
    the budget, which could leave the files that much over it."""
    counting = _runner(scripted_path, tmp_path)
    writing = _runner(scripted_path, tmp_path)  # its own reply memory: another process's
    writing.generate(ASK, max_tokens=20, temperature=0)
    writing._pool.store.flush()
    (record,) = _records(tmp_path)
    store = counting._pool.store
    blocks = sum(p.stat().st_size for p in tmp_path.glob(f"*/*{SUFFIX}"))
    assert store.nbytes > 0 and store.replies.nbytes == record.stat().st_size
    store.max_bytes = blocks + record.stat().st_size - 1
    store.enforce_budget()
    on_disk = [*tmp_path.glob(f"*/*{SUFFIX}"), *_records(tmp_path)]
    assert sum(p.stat().st_size for p in on_disk) <= store.max_bytes
    writing.close()
    counting.close()


def test_a_record_swept_before_the_turn_that_renders_it_is_written_again(scripted_path, tmp_path):
    """Under budget pressure a turn's blocks, and its reply's record with them, go while the
    conversation goes on in memory: its next turn renders the reply as its ids and writes a
    chain that holds them, so the record is written again behind it, and a restart renders
    the reply as those ids and reuses that turn (before, the record stayed gone: the restart
    rendered the reply from its text, 2 tokens fewer, and its reuse stopped there)."""
    runner = _runner(scripted_path, tmp_path)
    text, _, want_ids = _turn_one(runner)
    store = runner._pool.store
    store.flush()
    store.max_bytes = 1
    store.enforce_budget()  # as another conversation's turns would: every file goes
    assert _records(tmp_path) == [] and not list(tmp_path.glob(f"*/*{SUFFIX}"))
    store.max_bytes = 1 << 30
    second = runner.generate(_next_turn(text), max_tokens=2, temperature=0)
    assert second.cached_tokens > 0  # the conversation went on in memory
    assert second.text != text  # its own record is another
    runner.close()
    restarted = _runner(scripted_path, tmp_path)
    assert restarted.encode(_next_turn(text)) == want_ids
    got, _ = _answer(restarted, _next_turn(text))
    assert got.cached_tokens == len(want_ids) - 1  # all but the token a request runs
