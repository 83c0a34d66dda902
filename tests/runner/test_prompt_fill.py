"""A prompt's prefill in turns (`mlxkv.runner.prefill.fill.fill_prompt`): it pauses between
chunks, so running requests decode meanwhile, and not after the last one, so a short prompt's
first token comes in the same turn as its prefill."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from mlxkv.cache import make_cache
from mlxkv.decoding.pause import PAUSE
from mlxkv.decoding.prefill.chunks import PrefillPlan
from mlxkv.runner.prefill.fill import fill_prompt
from mlxkv.runner.prompt_cache.entry import CacheEntry
from mlxkv.runner.prompt_cache.pool import PrefixHit
from mlxkv.runner.results import CompletionStats


def _request(ids: list[int]) -> SimpleNamespace:
    """What `fill_prompt` reads of a request."""
    return SimpleNamespace(
        tokens=ids,
        header_tokens=0,
        keep=0,
        progress=None,
        matched=None,
        cancelled=threading.Event(),
    )


@pytest.mark.parametrize(("tokens", "pauses"), [(1, 0), (33, 0), (34, 1), (97, 2)])
def test_a_prefill_pauses_between_chunks_not_after_the_last(loaded_tiny, tokens, pauses):
    loaded = loaded_tiny("llama")
    cache = make_cache(loaded.model)
    ids = list(range(1, tokens + 1))
    request = _request(ids)
    stats = CompletionStats(time.perf_counter(), prompt_tokens=tokens, cached=0)
    steps = fill_prompt(
        loaded.model, request, PrefixHit(CacheEntry(cache), 0, ids), stats, plan=PrefillPlan(32, 1)
    )
    seen = 0
    while True:
        try:
            assert next(steps) is PAUSE
            seen += 1
        except StopIteration as end:
            logits = end.value
            break
    assert seen == pauses
    assert logits.shape[0] == 1 and cache.num_tokens == tokens and stats.processed == tokens


def test_a_pause_where_a_checkpoint_falls_comes_after_it(loaded_tiny):
    """A request waiting for this prefix (`_await_shared_prefix`) copies it at a pause: where
    the cache then ends on a checkpoint of layers that cannot trim back (LFM2's recurrent
    state), the checkpoint must be there already, or the copy goes back further."""
    loaded = loaded_tiny("lfm2")
    cache = make_cache(loaded.model)
    ids = list(range(1, 98))
    request = _request(ids)
    stats = CompletionStats(time.perf_counter(), prompt_tokens=len(ids), cached=0)
    hit = PrefixHit(CacheEntry(cache), 0, ids, checkpoints=(40,))
    steps = fill_prompt(loaded.model, request, hit, stats, plan=PrefillPlan(32, 1))
    paused_at = []
    while True:
        try:
            assert next(steps) is PAUSE
        except StopIteration:
            break
        paused_at.append((cache.num_tokens, sorted(cache.checkpoints)))
    assert paused_at == [(32, []), (40, [40]), (72, [40])]
