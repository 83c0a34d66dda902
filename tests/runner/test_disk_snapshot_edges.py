"""The disk tier's boundary snapshots at their edges (`mlxkv.runner.disk.snapshots`): a
restart then a divergence around a boundary, a prefill cancelled past a boundary, batched and
drafted (speculative) replies across a boundary, an entry evicted with its snapshots pending,
each against a fresh Runner without a disk tier (log-probabilities within 1e-4)."""

from __future__ import annotations

import threading

import pytest

from mlxkv import Runner
from mlxkv.decoding import drafts
from mlxkv.models.loading import load_model
from mlxkv.runner.disk.chains import BLOCK_TOKENS
from mlxkv.testing.factory import build_model
from mlxkv.testing.tiny_recurrent import QWEN3_NEXT_LARGE_STATE
from tests.runner.test_batching import _in_step
from tests.runner.test_disk_snapshots import _answer, _assert_same, _tokens


@pytest.fixture(scope="module")
def large_state(tmp_path_factory):
    out = tmp_path_factory.mktemp("models") / "qwen3_next"
    return load_model(build_model("qwen3_next", out, config_overrides=QWEN3_NEXT_LARGE_STATE))


@pytest.fixture
def runner_of(loaded_tiny):
    return lambda arch, **options: Runner(loaded_tiny(arch), **options)


@pytest.mark.parametrize("arch", ["lfm2", "gemma3_text"])
@pytest.mark.parametrize("shared", [BLOCK_TOKENS - 1, BLOCK_TOKENS, BLOCK_TOKENS + 1, 701, 704])
def test_a_restart_then_a_divergence_around_a_boundary_answers_as_fresh(
    runner_of, tmp_path, shared, arch
):
    stored = _tokens(21, 2 * BLOCK_TOKENS + 190)  # 701: its checkpoint; 704: in the reply
    before = runner_of(arch, cache_dir=tmp_path)
    reply = before.generate(stored, max_tokens=4, temperature=0).tokens
    before.close()
    prompt = (stored + reply)[:shared] + _tokens(22, 20)
    got = _answer(runner_of(arch, cache_dir=tmp_path), prompt)
    _assert_same(got, _answer(runner_of(arch), prompt))
    assert shared // BLOCK_TOKENS * BLOCK_TOKENS <= got[2] <= shared


def test_a_prefill_cancelled_past_a_boundary_keeps_no_snapshot_past_its_tokens(runner_of, tmp_path):
    runner = runner_of("lfm2", cache_dir=tmp_path, prefill_step_size=128)
    prompt = _tokens(23, 1000)

    def progress(done, total):
        if done >= 600:
            caller = threading.Thread(target=runner.cancel)
            caller.start()
            caller.join()

    out = runner.generate(prompt, max_tokens=4, progress=progress)
    assert out.finish_reason == "cancelled"
    for entry in runner._pool.entries:
        held = entry.cache.num_tokens
        assert all(n <= held for n in entry.cache._disk_snapshots), "a snapshot past the tokens"
    runner.close()
    diverging = prompt[:550] + _tokens(24, 20)
    got = _answer(runner_of("lfm2", cache_dir=tmp_path), diverging)
    _assert_same(got, _answer(runner_of("lfm2"), diverging))
    assert got[2] == 2 * BLOCK_TOKENS


def test_batched_replies_across_a_boundary_restore_after_a_restart(runner_of, tmp_path, rows):
    """Concurrent batched requests with max_batch=4: LFM2's rows decode in one batch, each
    crossing its boundary (10 to 12 tokens into its reply) at a step of its own."""
    runner = runner_of("lfm2", cache_dir=tmp_path, max_batch=4, speculative=None)
    prompts = [_tokens(30 + i, 2 * BLOCK_TOKENS - 10 - i) for i in range(3)]
    read = _in_step(runner, prompts, max_tokens=24, temperature=0)
    replies = [[c.token for c in chunks if c.token is not None] for chunks in read]
    assert max(rows) == 3
    runner.close()
    for i, stored in enumerate(prompts):
        prompt = stored + replies[i][:20] + _tokens(40 + i, 20)
        got = _answer(runner_of("lfm2", cache_dir=tmp_path), prompt)
        _assert_same(got, _answer(runner_of("lfm2"), prompt))
        assert got[2] >= 2 * BLOCK_TOKENS


def test_an_entry_evicted_with_its_snapshots_pending_writes_them(runner_of, tmp_path):
    runner = runner_of("lfm2", cache_dir=tmp_path, cache_entries=1)
    first = _tokens(52, 700)
    runner.generate(first, max_tokens=2, temperature=0)
    runner.generate(_tokens(53, 300), max_tokens=2, temperature=0)  # evicts the first
    runner._pool.clear()
    runner.close()
    prompt = first[:600] + _tokens(54, 20)
    got = _answer(runner_of("lfm2", cache_dir=tmp_path), prompt)
    _assert_same(got, _answer(runner_of("lfm2"), prompt))
    assert got[2] == 2 * BLOCK_TOKENS


@pytest.mark.parametrize("arch", ["lfm2", "gemma3_text"])
def test_oracle_drafts_across_a_boundary_restore_after_a_restart(
    runner_of, tmp_path, monkeypatch, arch
):
    """The n-gram drafter replaced by one proposing the greedy reply with every 3rd draft
    wrong: drafts accepted and rejected (`keep`'s rollback) across the boundary."""
    stored = _tokens(55, 2 * BLOCK_TOKENS - 13)
    want_reply = runner_of(arch, speculative=None).generate(stored, max_tokens=40, temperature=0)
    reference = want_reply.tokens
    calls = [0]

    def propose(self, limit):
        at = len(self._tokens) - len(stored)
        draft = list(reference[at : at + limit])
        calls[0] += 1
        if len(draft) > 2 and calls[0] % 2:
            draft[2] = (draft[2] + 1) % 400 + 10
        return drafts.Draft(draft)

    monkeypatch.setattr(drafts.NgramDrafter, "propose", propose)
    before = runner_of(arch, cache_dir=tmp_path, speculative="ngram")
    out = before.generate(stored, max_tokens=40, temperature=0)
    before.close()
    assert out.tokens == reference
    assert out.drafted_tokens > 0 and 0 < out.accepted_tokens < out.drafted_tokens
    prompt = stored + reference[:30] + _tokens(56, 20)
    got = _answer(runner_of(arch, cache_dir=tmp_path, speculative=None), prompt)
    _assert_same(got, _answer(runner_of(arch, speculative=None), prompt))
    assert got[2] == 2 * BLOCK_TOKENS  # a pass never crosses a snapshot's boundary


def test_the_rule_weighs_snapshots_against_the_kv_as_written_quantized(large_state, tmp_path):
    plain = Runner(large_state, cache_dir=tmp_path / "a")._pool.store.snapshot_every_tokens
    quantized = Runner(large_state, cache_dir=tmp_path / "b", cache_dir_kv_bits=4)._pool.store
    assert quantized.snapshot_every_tokens > plain  # the K/V beside them is smaller


def test_a_disk_tier_fits_the_window_with_the_snapshots_it_holds(large_state, tmp_path):
    """A long request holds its boundary snapshots until its turn is written: the window
    fitted to the same budget is smaller with a disk tier (not for a model that trims). The
    budget binds under the model's 4,096 positions: its state counts once, not per token."""
    memory_only = Runner(large_state, cache_bytes=2**20).max_context
    assert memory_only < 4096
    assert Runner(large_state, cache_bytes=2**20, cache_dir=tmp_path).max_context < memory_only
