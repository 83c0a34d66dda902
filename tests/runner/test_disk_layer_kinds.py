"""Blocks for every layer kind the cache holds: a conversation of a hybrid (recurrent), KV-shared,
sliding-window, chunked-attention or quantized-K/V model (or K/V quantized on disk only) is
written as blocks like a plain one, comes back in a new Runner answering as a fresh Runner does
(by log-probabilities) and reusing as many tokens as a cache that never left memory, and two
conversations over one prompt store its blocks once."""

from __future__ import annotations

import numpy as np
import pytest

from mlxkv.runner.disk import reading
from mlxkv.runner.disk import store as store_module
from tests.factories import recorded
from tests.runner.test_disk_tier import _chat, _files

BLOCK_TOKENS = 16
SYSTEM = "You are a careful assistant. " + " ".join(f"Rule {i}: be brief." for i in range(8))
# kind -> (architecture, Runner options); each has a layer kind the others lack
KINDS = {
    "plain": ("llama", {}),
    "hybrid": ("lfm2", {}),  # recurrent conv layers beside K/V
    "sliding-window": ("gemma3_text", {}),  # a window of 8 tokens
    "chunked": ("llama4", {}),  # chunked attention beside a global layer
    "kv-shared": ("gemma4_text", {}),  # its cache list padded for layers reading another's
    "quantized": ("llama-hd32", {"kv_bits": 8, "kv_group_size": 32}),
    "quantized-on-disk": ("llama-hd32", {"cache_dir_kv_bits": 8}),  # float K/V in memory
}
# K/V quantized on disk are not what a fresh prefill computes: the per-request check that an
# entry holds a fresh prefill's K/V cannot be their reference (the answers are compared here)
PARAMS = [
    pytest.param(kind, marks=pytest.mark.unchecked_entries) if "on-disk" in kind else kind
    for kind in KINDS
]
_LOADED: dict[tuple[str, str], object] = {}
# log-probabilities: the same computation in other chunks rounds otherwise; quantized K/V
# are quantized in other passes (tests/tolerances.py: 2^-8 relative at log-probs of O(10));
# K/V quantized on disk against float ones: measured up to 0.18 on this random model (its
# activations are large), against O(1) for K/V read back wrong
LOGPROB_ABS = {"quantized": 4e-2, "quantized-on-disk": 0.3}


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(store_module, "BLOCK_TOKENS", BLOCK_TOKENS)


@pytest.fixture
def make_runner(loaded_tiny, model_root):
    """A Runner of `kind`'s model and options, with these settings."""
    from mlxkv import Runner
    from mlxkv.models.loading import load_model
    from mlxkv.testing.factory import build_model

    def _make(kind: str, **kwargs):
        arch, options = KINDS[kind]
        if arch != "llama-hd32":
            return Runner(loaded_tiny(arch), **options, **kwargs)
        if (model_root, arch) not in _LOADED:  # quantized groups need a head dim of 32
            path = build_model("llama", f"{model_root}/{arch}", config_overrides={"head_dim": 32})
            _LOADED[model_root, arch] = load_model(path)
        return Runner(_LOADED[model_root, arch], **options, **kwargs)

    return _make


def _answer(runner, messages: list[dict]) -> tuple[list[int], list[float], int]:
    chunks = list(runner.stream(messages, max_tokens=6, temperature=0, logprobs=0))
    done = chunks[-1].completion
    return done.tokens, [c.logprob.logprob for c in chunks if c.logprob], done.cached_tokens


def _assert_same_answer(kind: str, got: tuple, want: tuple) -> None:
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=LOGPROB_ABS.get(kind, 1e-4))


@pytest.mark.parametrize("kind", PARAMS)
def test_a_conversation_restored_from_blocks_answers_as_a_fresh_runner(make_runner, tmp_path, kind):
    before = make_runner(kind, cache_dir=tmp_path)
    messages, _ = _chat(before, 3)
    before.close()
    assert len(_files(tmp_path)) > 2  # blocks, not one file for the entry
    follow_up = messages + [{"role": "user", "content": "And one more?"}]
    edited = messages[:-2] + [{"role": "user", "content": "Question 2: a river in Asia?"}]
    in_memory = make_runner(kind)  # the same requests, never restarted
    _chat(in_memory, 3)
    for request in (follow_up, edited):  # the whole conversation; back to a checkpoint
        restarted = make_runner(kind, cache_dir=tmp_path)
        got = _answer(restarted, request)
        _assert_same_answer(kind, got, _answer(make_runner(kind), request))
        assert got[2] > BLOCK_TOKENS  # from disk, past its first block
        if request is follow_up:
            assert got[2] == _answer(in_memory, request)[2]


@pytest.mark.parametrize("kind", PARAMS)
def test_two_conversations_over_one_prompt_share_its_blocks(make_runner, tmp_path, kind):
    runner = make_runner(kind, cache_entries=4, cache_dir=tmp_path)
    conversations = [
        _chat(runner, 2, start=[{"role": "system", "content": f"{SYSTEM} You are number {i}."}])[0]
        for i in range(2)
    ]
    store = runner._pool.store
    store.flush()
    shared = len(runner.encode([{"role": "system", "content": SYSTEM}])) // BLOCK_TOKENS
    assert shared >= 2
    records = list(store._records.values())
    assert len([r for r in records if r.start < shared * BLOCK_TOKENS]) == shared
    for messages in conversations:  # each a chain through those blocks to its own tail
        keys = store.block_keys(np.asarray(runner.encode(messages), dtype=np.uint32))
        assert {k + ".safetensors" for k in keys[:shared]} <= {r.path.name for r in records}
    runner.close()
    for messages in conversations:
        follow_up = messages + [{"role": "user", "content": "Why?"}]
        got = _answer(make_runner(kind, cache_dir=tmp_path), follow_up)
        _assert_same_answer(kind, got, _answer(make_runner(kind), follow_up))
        assert got[2] > shared * BLOCK_TOKENS


def test_kv_quantized_on_disk_takes_a_third_of_the_bytes(make_runner, tmp_path):
    sizes = {}
    for bits in (None, 8):
        runner = make_runner("quantized-on-disk", cache_dir=tmp_path / str(bits))
        runner._pool.store.kv_bits = bits
        _chat(runner, 2)
        runner.close()
        sizes[bits] = sum(p.stat().st_size for p in _files(tmp_path / str(bits)))
    # float32 K/V: 8 bits per element plus a float32 scale and bias per group of 32
    assert sizes[8] < 0.4 * sizes[None]


def test_cache_dir_kv_bits_other_than_4_or_8_is_a_clear_error():
    from mlxkv.config import RunnerConfig

    with pytest.raises(ValueError, match="cache_dir_kv_bits=3 is not supported"):
        RunnerConfig(cache_dir_kv_bits=3)


@pytest.mark.parametrize("kind", ["plain", "hybrid"])
def test_a_load_reads_only_the_blocks_it_restores(make_runner, tmp_path, monkeypatch, kind):
    before = make_runner(kind, cache_dir=tmp_path)
    messages, _ = _chat(before, 3)
    before.close()
    # the second turn edited: the prompt leaves the stored chain in its middle
    edited = messages[:3] + [{"role": "user", "content": "Question 1: a river in Asia?"}]
    read = recorded(monkeypatch, reading, "read_header", lambda path: path.name)
    restarted = make_runner(kind, cache_dir=tmp_path)
    starts = {r.path.name: r.start for r in restarted._pool.store._records.values()}
    got = _answer(restarted, edited)
    assert got[2] > BLOCK_TOKENS
    assert sorted(read) == sorted(name for name, start in starts.items() if start < got[2])
    assert len(read) < len(starts)  # the blocks past it stayed unread


@pytest.mark.parametrize(
    ("argv", "expected"),
    [(["serve"], None), (["serve", "--cache-dir-kv-bits", "8"], 8)],
    ids=["serve-default", "serve-8"],
)
def test_cli_cache_dir_kv_bits_option(argv, expected):
    from mlxkv.cli.common import runner_config
    from mlxkv.cli.parser import build_parser

    assert runner_config(build_parser().parse_args(argv)).cache_dir_kv_bits == expected
