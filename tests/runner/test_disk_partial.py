"""A partial restore: a load reads a chain's first blocks and the request prefills the rest,
when the read and prefill rates say that is quickest (`chains.cheapest_restore`) or when a block
past them cannot be read (truncated mid-read: one warning, the blocks before it kept). Either
answers as a fresh Runner does, by log-probabilities, for a plain and a hybrid model."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from mlxkv.runner.disk import reading
from mlxkv.runner.disk import store as store_module
from mlxkv.runner.disk.chains import StoredChain, cheapest_restore, partial_restores
from mlxkv.runner.disk.files import StoredEntry
from mlxkv.runner.prompt_cache import reuse as reuse_module
from tests.runner.test_disk_tier import _chat
from tests.tolerances import LOGPROB_ABS

BLOCK_TOKENS = 16


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(store_module, "BLOCK_TOKENS", BLOCK_TOKENS)


def _fake_chain(num_blocks: int, num_tokens: int, checkpoints=None) -> StoredChain:
    """A chain of `num_blocks` full blocks of 1,000 bytes each (files never read)."""
    blocks = tuple(
        StoredEntry(
            Path(f"{i:032x}.safetensors"),
            np.arange(i * BLOCK_TOKENS, (i + 1) * BLOCK_TOKENS, dtype=np.uint32),
            1000,
            checkpoints=() if checkpoints is None else checkpoints[i],
            start=i * BLOCK_TOKENS,
        )
        for i in range(num_blocks)
    )
    return StoredChain(blocks, num_tokens)


# (reuse in memory, tokens the chain serves, read bytes/s, prefill tokens/s) -> blocks loaded
# (0: prefill). 3 blocks of 16 tokens, 1,000 bytes each.
CHOICES = {
    # a block reads in 1 s and prefills in 4 s: loading pays for every block it serves whole
    "load-all": ((0, 46, 1000.0, 4.0), 3),
    # the last block serves 2 of its tokens: 1 s to read, 0.5 s to prefill
    "load-part": ((0, 34, 1000.0, 4.0), 2),
    "prefill": ((0, 46, 100.0, 100.0), 0),  # a block reads in 10 s and prefills in 0.16 s
    "memory-serves-most": ((32, 34, 1000.0, 4.0), 0),  # 2 tokens to prefill against 3 s
    "not-measured-yet": ((0, 34, 1000.0, None), 3),
}


@pytest.mark.parametrize("case", list(CHOICES))
def test_the_rule_loads_all_part_or_none_of_a_chain(case):
    (reuse, target, read_bytes_per_s, tokens_per_s), want_blocks = CHOICES[case]
    restores = partial_restores(_fake_chain(3, 48), trimmable=True)
    assert [r.num_tokens for r in restores] == [16, 32, 48]
    got = cheapest_restore(restores, reuse, target, read_bytes_per_s, tokens_per_s)
    assert (0 if got is None else len(got.blocks)) == want_blocks


def test_a_chain_with_state_layers_stops_only_where_a_block_holds_them():
    chain = _fake_chain(3, 40, checkpoints=[(10,), (), (40,)])
    restores = partial_restores(chain, trimmable=False)
    assert [(len(r.blocks), r.num_tokens) for r in restores] == [(1, 10), (3, 40)]


def _answer(runner, messages: list[dict]) -> tuple[list[int], list[float], int]:
    chunks = list(runner.stream(messages, max_tokens=6, temperature=0, logprobs=0))
    done = chunks[-1].completion
    return done.tokens, [c.logprob.logprob for c in chunks if c.logprob], done.cached_tokens


def _answers_as_fresh(restarted, make_runner, arch: str, messages, restored_tokens, caplog):
    """Answers `messages` on `restarted`: the same tokens and log-probabilities as a fresh
    Runner, reusing exactly `restored_tokens` (the rest prefilled). Returns the warnings."""
    with caplog.at_level(logging.WARNING, logger="mlxkv"):
        got = _answer(restarted, messages)
    want = _answer(make_runner(arch), messages)
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=LOGPROB_ABS)
    assert got[2] == restored_tokens
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def _stored_conversation(make_runner, arch: str, cache_dir: Path) -> list[dict]:
    """A three-turn conversation written by a closed Runner; its follow-up request."""
    before = make_runner(arch, cache_dir=cache_dir)
    messages, _ = _chat(before, 3)
    before.close()
    return messages + [{"role": "user", "content": "And one more?"}]


def _full_chain(runner, messages: list[dict]) -> StoredChain:
    tokens = np.asarray(runner.encode(messages), dtype=np.uint32)
    chain, _ = runner._pool.store.best(tokens, tokens.size - 1)
    return chain


@pytest.mark.parametrize("arch", ["llama", "lfm2"])
def test_a_partial_restore_by_the_rule_answers_as_a_fresh_runner(
    make_runner, tmp_path, monkeypatch, arch
):
    follow_up = _stored_conversation(make_runner, arch, tmp_path)
    restarted = make_runner(arch, cache_dir=tmp_path)
    store = restarted._pool.store
    restores = partial_restores(_full_chain(restarted, follow_up), trimmable=store.trimmable)
    assert len(restores) >= 2
    part = restores[-2]  # the rates made the chain's last blocks too dear to read
    assert 0 < part.num_tokens < restores[-1].num_tokens

    def dear_tail(*_):
        return part

    monkeypatch.setattr(reuse_module, "cheapest_restore", dear_tail)
    read = []
    real_check = reading.checked_header  # runs on worker threads: the order is not kept

    def recorded(block, **options):
        read.append(block.path.name)
        return real_check(block, **options)

    monkeypatch.setattr(reading, "checked_header", recorded)
    got = _answer(restarted, follow_up)
    want = _answer(make_runner(arch), follow_up)
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=LOGPROB_ABS)
    assert got[2] == part.num_tokens  # the first blocks loaded, the rest prefilled
    assert sorted(read) == sorted(b.path.name for b in part.blocks)


@pytest.mark.parametrize("arch", ["llama", "lfm2"])
def test_a_block_truncated_mid_read_keeps_the_blocks_before_it(make_runner, tmp_path, caplog, arch):
    follow_up = _stored_conversation(make_runner, arch, tmp_path)
    restarted = make_runner(arch, cache_dir=tmp_path)  # the directory indexed whole
    chain = _full_chain(restarted, follow_up)
    before = partial_restores(chain, trimmable=restarted._pool.store.trimmable)[-2]
    assert 0 < before.num_tokens < chain.num_tokens
    bad = chain.blocks[-1].path
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])  # torn after indexing
    warnings = _answers_as_fresh(restarted, make_runner, arch, follow_up, before.num_tokens, caplog)
    assert len([w for w in warnings if bad.name in w]) == 1
    assert not bad.exists()  # ours and corrupt: removed


def test_the_rates_alone_make_a_restart_load_part_of_a_chain(make_runner, tmp_path):
    """No stand-in for the rule: a prompt that leaves the stored chain 2 tokens into its third
    block, a block read in 1 s and 4 tokens prefilled a second, loads the first two blocks."""
    stored = [int(t) for t in np.random.default_rng(3).integers(10, 500, 60)]
    before = make_runner("llama", cache_dir=tmp_path)
    before.generate(stored, max_tokens=1)
    before.close()
    prompt = stored[:34] + [int(t) for t in np.random.default_rng(4).integers(10, 500, 12)]
    restarted = make_runner("llama", cache_dir=tmp_path)
    store = restarted._pool.store
    store.read_bytes_per_s = float(max(r.nbytes for r in store._records.values()))
    restarted._pool.prefill_tokens_per_s = 4.0
    got = _answer(restarted, prompt)
    want = _answer(make_runner("llama"), prompt)
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=LOGPROB_ABS)
    assert got[2] == 2 * BLOCK_TOKENS


@pytest.mark.parametrize("arch", ["llama", "lfm2"])
def test_a_block_removed_after_its_check_is_forgotten_without_a_warning(
    make_runner, tmp_path, caplog, monkeypatch, arch
):
    """The writer removes a block another one supersedes while a request reads its chain
    (seen 2 times in 200 turns under a small budget): MLX's open then fails with a
    RuntimeError, which said "could not read ... now; the file is kept" of a file gone."""
    follow_up = _stored_conversation(make_runner, arch, tmp_path)
    restarted = make_runner(arch, cache_dir=tmp_path)
    store = restarted._pool.store
    chain = _full_chain(restarted, follow_up)
    before = partial_restores(chain, trimmable=store.trimmable)[-2]
    gone = chain.blocks[-1].path
    real_check = reading.checked_header

    def removed_once_checked(block, **options):
        header = real_check(block, **options)
        if block.path == gone:
            gone.unlink()
        return header

    monkeypatch.setattr(reading, "checked_header", removed_once_checked)
    warnings = _answers_as_fresh(restarted, make_runner, arch, follow_up, before.num_tokens, caplog)
    assert warnings == []
    assert gone.name not in store._records
