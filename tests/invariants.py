"""The prompt cache's invariant, checked after every request a test's Runner serves.

An entry's recorded token ids are, in order, what its K/V were computed from: the request's
prompt and then the tokens it streamed (the last one fed or not, as decoding's pipeline left
it), possibly followed by tokens the model produced but the caller never saw (an EOS, drafts
accepted after a stop string); and feeding those ids to a fresh cache gives the same next
token logits. `tests/conftest.py` applies it to every Runner through `checked_runners`, an
observer of `mlxkv.runner.hooks.request_ends`.
"""

from __future__ import annotations

import mlx.core as mx

from mlxkv.cache.building import make_cache
from mlxkv.decoding.prefill.chunks import PrefillPlan, fill
from mlxkv.models.vision import ImagePrompt
from tests.tolerances import assert_logits_close

# An EOS, or the rest of an accepted draft after a stop string (drafts are at most 16 long).
_MOST_UNSEEN_TOKENS = 17


def assert_entry_holds_what_it_fed(context, entry, fed: list[int], images: tuple = ()) -> None:
    """Checks the entry a request ended with, given the ids it fed (its prompt, then the tokens
    it streamed) and its prompt's images (`ImageSpan`s); call on the engine thread. `context`
    has `loaded` and `config` (a Runner's `RunContext`)."""
    if entry.cache.num_tokens == 0:
        return
    tokens = entry.cache.tokens
    if len(fed) + 1 < context.config.max_context:  # a shift drops tokens: no order to check
        expected = fed
        assert tokens[: len(expected)] == expected[: len(tokens)], (
            "the entry's token ids are not the prompt and the reply, in order"
        )
        unseen = len(tokens) - len(expected)
        assert unseen <= _MOST_UNSEEN_TOKENS, f"{unseen} tokens past what the request streamed"
    if not entry.cache.shifted:  # a shift in place approximates (docs/long-conversations.md)
        _assert_same_as_fresh_prefill(context, entry.cache, tokens, images)


def assert_recorded_bytes_current(pool) -> None:
    """Every entry no request uses has its bytes as recorded at its request's end (what the
    budget and the memory line read) equal to what its caches hold now: nothing changed an
    idle entry without recording it again."""
    for entry in pool.entries:
        if entry in pool._in_use:
            continue
        assert entry.recorded is not None, "an idle entry never recorded"
        footprint, draft = entry.recorded
        assert _figures(footprint) == _figures(entry.cache.footprint()), "stale recorded bytes"
        live_draft = None if entry.draft_cache is None else entry.draft_cache.footprint()
        assert _figures(draft) == _figures(live_draft), "stale recorded draft bytes"


def _figures(footprint) -> tuple | None:
    if footprint is None:
        return None
    f = footprint
    snapshots = sorted(id(s) for s in f.snapshots)
    return f.num_tokens, f.used_bytes, f.allocated_bytes, f.checkpoint_bytes, snapshots


def _assert_same_as_fresh_prefill(runner, cache, tokens: list[int], images: tuple) -> None:
    model = runner.loaded.model
    if images:  # the prompt's images spliced in, at its M-RoPE positions
        model = ImagePrompt(model, runner.pool.encoder, tokens, images)
    config = runner.config
    fresh = make_cache(model, kv_bits=config.kv_bits, kv_group_size=config.kv_group_size)
    probe = [tokens[-1]]
    fill(model, fresh, tokens, PrefillPlan(512))
    want = fresh.forward(model, probe)
    copy = cache.copy()
    copy.capacity_tokens = None  # an entry that filled the window still takes the probe
    got = copy.forward(model, probe)
    mx.eval(want, got)
    # quantized K/V fed in other chunks quantize other roundings (tests/tolerances.py)
    what = "the entry's K/V against a fresh prefill of its token ids"
    assert_logits_close(got, want, what, kv_bits=config.kv_bits)
