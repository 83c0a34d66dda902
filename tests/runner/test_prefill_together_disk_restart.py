"""Review: prompts of sliding-window and hybrid models prefilled together write the disk tier's
blocks a plain prefill writes (one prompt ending exactly on a block boundary, others crossing
one or two); a new Runner on the same directory, asked prompts that leave each stored prompt
inside a block past a boundary, reuses as many tokens as after plain prefills and answers as a
fresh Runner with no cache."""

from __future__ import annotations

import pytest

from mlxkv import Runner
from mlxkv.runner.disk import store as store_module
from mlxkv.runner.prefill import group as prefill_group
from mlxkv.runner.prefill.group import PrefillGroup
from tests.factories import recorded
from tests.runner.test_batching import (
    _assert_same_answers,
    _first_jobs_queued_then_run,
    _tokens_and_logprobs,
)

BLOCK_TOKENS = 16
OPTIONS = {"max_tokens": 4, "temperature": 0.0, "logprobs": 0}
# lengths 48 (ends on a boundary), 41, 35, 33: fed together (within twice the shortest)
PROMPTS = [[(7 * i + 3 * k) % 400 + 20 for i in range(n)] for k, n in enumerate((48, 41, 35, 33))]


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(store_module, "BLOCK_TOKENS", BLOCK_TOKENS)


def _stored(loaded, directory, monkeypatch, *, together: bool) -> list:
    runner = Runner(loaded, max_batch=4, cache_entries=8, max_context=512, cache_dir=directory)
    with monkeypatch.context() as patch:
        if not together:
            patch.setattr(PrefillGroup, "admits", lambda *_: False)
        passes = recorded(
            patch, prefill_group, "prefill_together",
            lambda _model, _caches, fed, **_: sorted(len(t) for t in fed),
        )  # fmt: skip
        got = _first_jobs_queued_then_run(runner, PROMPTS, [OPTIONS] * len(PROMPTS))
    runner.close()
    assert None not in got
    return passes


@pytest.mark.parametrize("arch", ["gemma3_text", "lfm2", "spark2_5"])
def test_blocks_of_prompts_prefilled_together_restore_as_plain_ones(
    loaded_tiny, tmp_path, monkeypatch, arch
):
    loaded = loaded_tiny(arch)
    passes = _stored(loaded, tmp_path / "together", monkeypatch, together=True)
    assert passes and max(map(len, passes)) >= 2, passes
    assert _stored(loaded, tmp_path / "plain", monkeypatch, together=False) == []
    fresh = Runner(loaded, speculative=None, max_context=512)
    for prompt in PROMPTS:
        for cut in (BLOCK_TOKENS + 3, 2 * BLOCK_TOKENS, 2 * BLOCK_TOKENS + 1, len(prompt) - 1):
            query = prompt[:cut] + [5, 6, 7]
            want = _tokens_and_logprobs(fresh.stream(query, **OPTIONS))
            cached = {}
            for name in ("together", "plain"):
                restarted = Runner(loaded, max_context=512, cache_dir=tmp_path / name)
                chunks = list(restarted.stream(query, **OPTIONS))
                restarted.close()
                _assert_same_answers([_tokens_and_logprobs(chunks)], [want])
                cached[name] = chunks[-1].completion.cached_tokens
            assert cached["together"] == cached["plain"], (len(prompt), cut, cached)
            assert cached["together"] >= BLOCK_TOKENS, (len(prompt), cut, cached)
