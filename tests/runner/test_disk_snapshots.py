"""State layers snapshotted at block boundaries for the disk tier (`mlxkv.runner.disk.snapshots`):
a prompt diverging inside a stored conversation of a hybrid, sliding-window or large-state model
restores to the last boundary snapshot before it and answers as a fresh Runner does, by
log-probabilities; the prefill split at the boundaries computes what an unsplit one does; the
cost rule's interval from the models' real layer sizes; what the snapshots hold in memory."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mlxkv import Runner
from mlxkv.cache.checkpoints import MAX_CHECKPOINTS
from mlxkv.cache.footprint import SnapshotCost
from mlxkv.cache.model_cache import ModelCache
from mlxkv.decoding.prefill import chunks
from mlxkv.models.loading import load_model
from mlxkv.runner.disk.chains import BLOCK_TOKENS
from mlxkv.runner.disk.snapshots import MIN_BLOCK_KV_BYTES, boundaries, snapshot_every_blocks
from mlxkv.testing.factory import build_model
from mlxkv.testing.tiny_recurrent import QWEN3_NEXT_LARGE_STATE
from tests.tolerances import LOGPROB_ABS

STORED_TOKENS = 1000
SHARED_TOKENS = 700  # the new prompt's tokens in common with the stored one


@pytest.fixture(scope="module")
def large_state(tmp_path_factory):
    out = tmp_path_factory.mktemp("models") / "qwen3_next"
    return load_model(build_model("qwen3_next", out, config_overrides=QWEN3_NEXT_LARGE_STATE))


@pytest.fixture
def runner_of(loaded_tiny, large_state):
    def make(arch: str, **options) -> Runner:
        return Runner(large_state if arch == "large_state" else loaded_tiny(arch), **options)

    return make


def _tokens(seed: int, count: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(10, 500, count)]


def _answer(runner: Runner, prompt: list[int]) -> tuple[list[int], list[float], int]:
    chunks_out = list(runner.stream(prompt, max_tokens=6, temperature=0, logprobs=0))
    done = chunks_out[-1].completion
    return done.tokens, [c.logprob.logprob for c in chunks_out if c.logprob], done.cached_tokens


def _assert_same(got, want) -> None:
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=LOGPROB_ABS)


@pytest.mark.parametrize("arch", ["lfm2", "gemma3_text", "large_state"])
def test_a_prompt_diverging_mid_chain_restores_to_the_boundary_before(runner_of, tmp_path, arch):
    stored = _tokens(3, STORED_TOKENS)
    before = runner_of(arch, cache_dir=tmp_path)
    before.generate(stored, max_tokens=4, temperature=0)
    before.close()
    prompt = stored[:SHARED_TOKENS] + _tokens(4, 40)
    got = _answer(runner_of(arch, cache_dir=tmp_path), prompt)
    _assert_same(got, _answer(runner_of(arch), prompt))
    # every model here snapshots at 512 (LFM2 and Gemma 3 every boundary, this one every 2nd)
    assert got[2] == 2 * BLOCK_TOKENS


@pytest.mark.parametrize("arch", ["lfm2", "gemma3_text"])
def test_a_reply_that_crosses_a_boundary_is_snapshotted_there(runner_of, tmp_path, arch):
    stored = _tokens(9, 2 * BLOCK_TOKENS - 12)
    before = runner_of(arch, cache_dir=tmp_path, speculative=None)
    reply = before.generate(stored, max_tokens=30, temperature=0).tokens
    before.close()
    prompt = stored + reply[:20] + _tokens(10, 30)  # diverges 8 tokens past the boundary
    got = _answer(runner_of(arch, cache_dir=tmp_path), prompt)
    _assert_same(got, _answer(runner_of(arch), prompt))
    assert got[2] == 2 * BLOCK_TOKENS


@pytest.mark.parametrize("arch", ["lfm2", "large_state"])
def test_the_prefill_split_at_boundaries_computes_what_an_unsplit_one_does(
    runner_of, tmp_path, monkeypatch, arch
):
    fed: list[tuple[ModelCache, int]] = []
    feed = chunks.cpu_lanes.feed

    def recorded(model, cache, tokens, lanes):
        fed.append((cache, len(tokens)))
        return feed(model, cache, tokens, lanes)

    def request_chunks() -> list[int]:  # the request's (the invariant check prefills too)
        sizes = [size for cache, size in fed if cache is fed[0][0]]
        fed.clear()
        return sizes

    monkeypatch.setattr(chunks.cpu_lanes, "feed", recorded)
    prompt = _tokens(5, STORED_TOKENS)
    split = runner_of(arch, cache_dir=tmp_path, prefill_step_size=512)
    unsplit = runner_of(arch, prefill_step_size=512)
    every = split._pool.store.snapshot_every_tokens
    fed.clear()  # the warm-ups'
    got = _answer(split, prompt)
    split_chunks = request_chunks()
    want = _answer(unsplit, prompt)
    _assert_same(got, want)
    assert request_chunks() == [512, STORED_TOKENS - 1 - 512]  # no disk tier: no split
    cuts = [*boundaries(0, STORED_TOKENS, every), STORED_TOKENS - 1]
    assert split_chunks == [b - a for a, b in zip([0, *cuts], cuts, strict=False)]
    split.close()
    stops = {n for r in split._pool.store._records.values() for n in r.checkpoints}
    assert set(boundaries(0, STORED_TOKENS, every)) <= stops


def test_without_a_disk_tier_nothing_is_snapshotted(runner_of, monkeypatch):
    def refused(self):
        raise AssertionError("a disk snapshot without a disk tier")

    monkeypatch.setattr(ModelCache, "snapshot_for_disk", refused)
    runner_of("lfm2").generate(_tokens(6, STORED_TOKENS), max_tokens=2)


def _snapshot_bytes_by_config(config: dict) -> tuple[int, int]:
    """(one snapshot of the GatedDeltaNet layers' state, K/V bytes a token of the attention
    layers) of a float32 qwen3_next `config`, from its numbers alone."""
    value_dim = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    key_dim = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    conv = (config["linear_conv_kernel_dim"] - 1) * (2 * key_dim + value_dim)
    state = value_dim * config["linear_key_head_dim"]
    num_attention = config["num_hidden_layers"] // config["full_attention_interval"]
    num_linear = config["num_hidden_layers"] - num_attention
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = num_attention * 2 * config["num_key_value_heads"] * head_dim
    return 4 * num_linear * (conv + state), 4 * per_token


def test_the_rule_snapshots_every_boundary_for_lfm2_and_every_kth_for_a_large_state(
    runner_of, tmp_path, large_state
):
    lfm2 = runner_of("lfm2", cache_dir=tmp_path / "a")._pool.store
    assert lfm2.snapshot_every_tokens == BLOCK_TOKENS
    snapshot_bytes, kv_per_token = _snapshot_bytes_by_config(large_state.config)
    k = math.ceil(snapshot_bytes / (kv_per_token * BLOCK_TOKENS))
    assert k > 1
    store = runner_of("large_state", cache_dir=tmp_path / "b")._pool.store
    assert store.snapshot_every_tokens == k * BLOCK_TOKENS
    assert runner_of("llama", cache_dir=tmp_path / "c")._pool.store.snapshot_every_tokens is None


RULE = {  # (snapshot bytes, K/V bytes a token, block tokens) -> every how many boundaries
    "cheaper-than-a-block": ((12_000, 100, 256), 1),
    "as-dear-as-a-block": ((25_600, 100, 256), 1),
    "qwen3-next-80b": ((72 * 2**20, 24 * 2**10, 256), 12),
    "no-layer-trims": ((3 * MIN_BLOCK_KV_BYTES, 0, 256), 3),
}


@pytest.mark.parametrize("case", list(RULE))
def test_the_rule_bounds_snapshot_bytes_by_the_kv_beside_them(case):
    (snapshot_bytes, per_token, block_tokens), want = RULE[case]
    cost = SnapshotCost(snapshot_bytes=snapshot_bytes, kv_bytes_per_token=per_token)
    assert snapshot_every_blocks(cost, block_tokens) == want


def test_snapshots_wait_in_the_budget_until_the_writer_takes_them(runner_of, tmp_path, held_writes):
    release, started = held_writes
    runner = runner_of("lfm2", cache_dir=tmp_path)
    pool = runner._pool
    runner.generate(_tokens(7, STORED_TOKENS), max_tokens=2)
    (entry,) = pool.entries
    # handed to the writer: the entry holds its checkpoints alone, the writer the snapshots
    assert entry.cache.take_disk_snapshots() == {}
    assert len(entry.cache.checkpoints) <= MAX_CHECKPOINTS
    queued = [name for job in pool.store._writer._queued.values() for name in job.arrays]
    assert {f"c{n}.0.0" for n in (256, 512, 768)} <= set(queued)  # LFM2's conv layer 0
    assert pool.store.pending_writes.nbytes > 0
    assert pool.nbytes >= entry.recorded[0].allocated_bytes + pool.store.pending_writes.nbytes
    release.set()
    pool.store.flush()
    assert pool.store.pending_writes.nbytes == 0
    runner.close()


def test_a_trim_drops_the_snapshots_past_it_and_a_copy_shares_those_before(runner_of):
    runner = runner_of("lfm2")
    cache = runner._make_entry()
    model = runner.loaded.model
    for step in range(3):
        cache.feed(model, _tokens(8 + step, 8))
        if step == 1:  # memory goes back only to its checkpoints
            cache.checkpoint()
        cache.snapshot_for_disk()
    assert sorted(cache.checkpoints) == [16]
    copy = cache.copy_prefix(16)
    cache.rewind_to(16)
    shared = copy.take_disk_snapshots()
    assert sorted(shared) == [8, 16]
    assert shared[16] is cache.checkpoints[16]  # one snapshot, not a copy
    assert sorted(cache.take_disk_snapshots()) == [8, 16]
