"""A load that meets another process's write: between the lookup that chose a chain on disk
(`DiskStore.best`) and its load, another store on the same directory wrote the conversation's
next turn, whose block superseded (removed) the chain's last one. The load looks again, once,
and restores what the directory holds then, answering as a fresh Runner does."""

from __future__ import annotations

import pytest

from mlxkv import Runner
from mlxkv.runner.disk import store as store_module
from tests.runner.test_batching import _tokens_and_logprobs
from tests.tolerances import LOGPROB_ABS

NO_EOS = {0: -100.0, 1: -100.0, 2: -100.0}  # the factory's special tokens
OPTIONS = {"max_tokens": 6, "logprobs": 0, "logit_bias": NO_EOS}


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(store_module, "BLOCK_TOKENS", 16)


def test_a_load_whose_block_another_store_superseded_meanwhile_restores_the_new_one(
    make_runner, loaded_tiny, tmp_path
):
    writer = make_runner("llama", cache_dir=tmp_path, speculative=None)
    writer.generate(list(range(3, 43)), **OPTIONS)  # 45 tokens held: blocks of 16, 16 and 13
    writer._pool.store.flush()
    prompt = [*writer.cache_tokens, 7, 8, 9, 10, 11, 12]  # the conversation goes on

    reader = make_runner("llama", cache_dir=tmp_path, speculative=None)
    store = reader._pool.store
    load, chosen = store.load, []

    def superseded_first(chain, empty, **kwargs):
        """Before the first load: the writer's next turn replaces the chain's tail block."""
        if not chosen:
            chosen.append(len(chain.blocks))
            writer.generate(prompt, **OPTIONS)
            writer._pool.store.flush()
            assert not chain.blocks[-1].path.exists()  # superseded, removed by the writer
        return load(chain, empty, **kwargs)

    store.load = superseded_first
    reader._pool.prefill_tokens_per_s = None  # the longest restore is loaded
    chunks = list(reader.stream(prompt, **OPTIONS))
    assert chosen == [3]  # blocks of 16, 16 and the tail
    assert chunks[-1].completion.cached_tokens == len(prompt) - 1  # the new tail, not 32
    got = _tokens_and_logprobs(iter(chunks))
    want = _tokens_and_logprobs(
        Runner(loaded_tiny("llama"), speculative=None).stream(prompt, **OPTIONS)
    )
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=LOGPROB_ABS)
