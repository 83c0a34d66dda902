"""The prompt cache's invariant, checked after every request a test's Runner serves.

An entry's recorded token ids are, in order, what its K/V were computed from: the request's
prompt and then the tokens it streamed (the last one fed or not, as decoding's pipeline left
it), possibly followed by tokens the model produced but the caller never saw (an EOS, drafts
accepted after a stop string); and feeding those ids to a fresh cache gives the same next
token logits. `tests/conftest.py` applies it to every Runner through `checked_runners`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import mlx.core as mx

from mlxkv.cache.building import make_cache
from mlxkv.decoding.prefill import PrefillPlan, fill
from mlxkv.models.vision import ImagePrompt
from tests.tolerances import assert_logits_close

# An EOS, or the rest of an accepted draft after a stop string (drafts are at most 16 long).
_MOST_UNSEEN_TOKENS = 17


@dataclass
class Fed:
    """What one request fed: its prompt ids and the tokens it streamed."""

    prompt: list[int]
    generated: list[int] = field(default_factory=list)
    images: tuple = ()  # the prompt's `ImageSpan`s


def assert_entry_holds_what_it_fed(runner, entry, fed: Fed | None) -> None:
    """Checks the entry a request of the runner ended with (call on the engine thread);
    `runner` is the Runner or its `Dispatcher` (either has `loaded`, `config` and
    `max_context`)."""
    if entry.cache.num_tokens == 0:
        return
    tokens = entry.cache.tokens
    if fed is not None and _no_shift_possible(runner, fed):
        expected = fed.prompt + fed.generated
        assert tokens[: len(expected)] == expected[: len(tokens)], (
            "the entry's token ids are not the prompt and the reply, in order"
        )
        unseen = len(tokens) - len(expected)
        assert unseen <= _MOST_UNSEEN_TOKENS, f"{unseen} tokens past what the request streamed"
    if not getattr(entry.cache, "shifted", False):  # a shift in place approximates (README)
        _assert_same_as_fresh_prefill(
            runner, entry.cache, tokens, () if fed is None else fed.images
        )


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


def _no_shift_possible(runner, fed: Fed) -> bool:
    """A context shift drops tokens from the middle: no order to check then."""
    return len(fed.prompt) + len(fed.generated) + 1 < runner.max_context


def _assert_same_as_fresh_prefill(runner, cache, tokens: list[int], images: tuple) -> None:
    model = runner.loaded.model
    if images:  # the prompt's images spliced in, at its M-RoPE positions
        model = ImagePrompt(model, runner.loaded.vision, tokens, images)
    config = runner.config
    fresh = make_cache(model, kv_bits=config.kv_bits, kv_group_size=config.kv_group_size)
    probe = [tokens[-1]]
    fill(model, fresh, tokens, PrefillPlan(512))
    want = fresh.forward(model, probe)
    got = cache.copy().forward(model, probe)
    mx.eval(want, got)
    assert_logits_close(got, want, "the entry's K/V against a fresh prefill of its token ids")


def recording(chunks: Iterator, fed: Fed) -> Iterator:
    """Wraps the chunks of `Dispatcher._run`, noting in `fed` each token the request streams."""
    try:
        for chunk in chunks:
            if chunk is not None and chunk.token is not None:
                fed.generated.append(chunk.token)
            yield chunk
    finally:
        chunks.close()
