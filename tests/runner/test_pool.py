"""CachePool against brute force: the reuse it picks is the longest common prefix over the
entries, every entry's K/V holds exactly its token ids (copies included), and the count and
byte budgets hold after every request."""

from __future__ import annotations

import hypothesis.strategies as st
import mlx.core as mx
import pytest
from hypothesis import given, settings

from mlxkv.cache import KVCache, ModelCache, SlidingWindowCache
from mlxkv.runner.disk.store import DiskStore
from mlxkv.runner.prompt_cache.pool import CachePool
from tests.factories import make_kv, positions_of
from tests.invariants import assert_recorded_bytes_current

LAYERS = 2


class _IdWriter:
    """Stands in for a model: each layer's K/V for a token is the token's id."""

    def __call__(self, ids: mx.array, cache) -> mx.array:
        for layer in cache:
            layer.update_and_fetch(*make_kv(ids.reshape(-1).tolist()))
        return mx.zeros((1, ids.shape[1], 1))


def _make_entry() -> ModelCache:
    def make_layers():
        return [KVCache(step=4) for _ in range(LAYERS)]

    return ModelCache(make_layers(), make_layers)


def _request(pool: CachePool, tokens: list[int], extra: list[int] = (), reply_start=None):
    """One request: look up, feed the rest and `extra` (a reply), release."""
    hit = pool.fetch_nearest(tokens, reply_start=reply_start)
    hit.entry.cache.forward(_IdWriter(), hit.remaining + list(extra))
    pool.release(hit.entry)
    return hit


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _check_entries(pool: CachePool) -> None:
    for entry in pool.entries:
        held = entry.cache.tokens
        assert entry.tokens.tolist() == held
        for layer in entry.cache:
            assert layer.offset == len(held)
            assert positions_of(layer.state[0]) == held  # K/V really are these tokens'
    assert_recorded_bytes_current(pool)


# Prompts from a tiny alphabet share prefixes often: hits, copies, trims and misses all occur.
_prompts = st.lists(st.integers(1, 3), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(
    requests=st.lists(st.tuples(_prompts, st.lists(st.integers(1, 3), max_size=3)), max_size=12),
    max_entries=st.integers(1, 4),
    budget_tokens=st.one_of(st.none(), st.integers(8, 40)),
)
def test_fetch_nearest_agrees_with_brute_force(requests, max_entries, budget_tokens):
    # one token of one layer is 2 heads x 4 dims x 4 bytes, keys and values
    max_bytes = None if budget_tokens is None else budget_tokens * LAYERS * 64
    pool = CachePool(_make_entry, max_entries=max_entries, max_bytes=max_bytes)
    for prompt, reply in requests:
        held = [e.cache.tokens for e in pool.entries]
        want = max((min(_lcp(h, prompt), len(prompt) - 1) for h in held), default=0)
        hit = _request(pool, prompt, reply)
        assert hit.num_cached == want
        assert hit.remaining == prompt[want:]
        _check_entries(pool)
        assert len(pool.entries) <= max_entries
        if max_bytes is not None:
            assert pool.nbytes <= max_bytes


def test_a_prefix_shared_by_another_conversation_is_copied_not_taken():
    pool = CachePool(_make_entry, max_entries=4)
    system = [7, 7, 7, 7]
    first = system + [1, 1, 1]
    _request(pool, first, [5, 5], reply_start=len(first))
    hit = _request(pool, system + [2, 2], [6], reply_start=6)
    assert hit.num_cached == len(system)
    held = sorted(e.cache.tokens for e in pool.entries)
    assert held == sorted([first + [5, 5], system + [2, 2, 6]])
    _check_entries(pool)


def test_a_reply_rendered_back_differently_trims_in_place():
    pool = CachePool(_make_entry, max_entries=4)
    prompt = [7, 7, 1, 1]
    _request(pool, prompt, [5, 5, 5], reply_start=len(prompt))
    hit = _request(pool, prompt + [5, 9, 2], [6], reply_start=7)
    assert hit.num_cached == len(prompt) + 1
    assert [e.cache.tokens for e in pool.entries] == [prompt + [5, 9, 2, 6]]


def test_one_entry_trims_in_place_like_a_single_cache():
    pool = CachePool(_make_entry, max_entries=1)
    _request(pool, [7, 7, 1, 1], [5])
    hit = _request(pool, [7, 7, 2], [6])
    assert hit.num_cached == 2
    assert [e.cache.tokens for e in pool.entries] == [[7, 7, 2, 6]]


def test_eviction_takes_superseded_entries_first_then_least_recently_used():
    pool = CachePool(_make_entry, max_entries=3)
    _request(pool, [1, 1, 1, 1, 1], [1])  # A
    hit = pool.fetch_nearest([1, 1, 1, 9], reply_start=4)  # B: a copy of A's first 3 tokens
    assert hit.num_cached == 3
    pool.release(hit.entry)  # B is fed nothing (a cancelled request): a strict prefix of A
    _request(pool, [2, 2, 2], [2])  # C, the newest
    _request(pool, [3, 3, 3], [3])  # D: over the count by one
    held = sorted(e.cache.tokens for e in pool.entries)
    assert held == [[1, 1, 1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]]  # B went, not A (older)
    _request(pool, [4, 4, 4], [4])
    held = sorted(e.cache.tokens for e in pool.entries)
    assert held == [[2, 2, 2, 2], [3, 3, 3, 3], [4, 4, 4, 4]]  # then A, least recently used


def test_an_entry_alone_over_the_byte_budget_keeps_its_longest_prefix_that_fits():
    budget = 8 * LAYERS * 64
    pool = CachePool(_make_entry, max_entries=4, max_bytes=budget)
    _request(pool, [1] * 5, [1])
    assert len(pool.entries) == 1
    _request(pool, list(range(2, 22)), [22])  # 21 tokens: the other entry goes, then its tail
    (entry,) = pool.entries
    kept = entry.cache.tokens
    assert 0 < len(kept) < 21 and kept == list(range(2, 2 + len(kept)))
    assert entry.tokens.tolist() == kept and pool.nbytes <= budget
    hit = pool.fetch_nearest(list(range(2, 30)))
    assert hit.num_cached == len(kept)


def test_a_request_released_before_a_later_one_keeps_its_prefix_that_fits():
    """A decode batch ends its requests out of order: the one released is not the latest
    entry (a later request's is), and alone over the budget it is fitted, not dropped."""
    budget = 8 * LAYERS * 64
    pool = CachePool(_make_entry, max_entries=4, max_bytes=budget)
    early = pool.fetch_nearest(list(range(2, 22)))
    later = pool.fetch_nearest([1, 1, 1])
    later.entry.cache.forward(_IdWriter(), later.remaining)
    early.entry.cache.forward(_IdWriter(), early.remaining + [22])
    assert pool.latest is later.entry
    pool.release(early.entry)
    kept = early.entry.cache.tokens
    assert early.entry in pool.entries and 0 < len(kept) < 21
    assert kept == list(range(2, 2 + len(kept))) and early.entry.tokens.tolist() == kept
    pool.release(later.entry)
    _check_entries(pool)


def test_an_entry_not_even_a_token_of_which_fits_is_evicted():
    pool = CachePool(_make_entry, max_entries=4, max_bytes=1)
    _request(pool, [2] * 20, [2])
    assert pool.entries == [] and pool.nbytes == 0


def test_empty_tokens_are_refused():
    with pytest.raises(ValueError, match="empty"):
        CachePool(_make_entry).fetch_nearest([])


def test_an_entry_in_use_is_copied_from_never_trimmed_extended_or_evicted():
    """Interleaved requests (a decode batch): while one request generates into an entry, a
    request sharing part of it gets a copy of that part, and eviction passes it over."""
    pool = CachePool(_make_entry, max_entries=2)
    _request(pool, [1, 2, 3, 4], [5, 6])
    first = pool.fetch_nearest([1, 2, 3, 4, 5, 6, 7], reply_start=2)  # in place: in use
    in_use = first.entry
    first.entry.cache.forward(_IdWriter(), first.remaining + [8, 9])
    second = pool.fetch_nearest([1, 2, 3, 9])  # would trim the entry were it free
    assert second.entry is not in_use and second.num_cached == 3
    assert in_use.cache.tokens == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    second.entry.cache.forward(_IdWriter(), second.remaining)
    pool.release(second.entry)
    pool.evict(max_entries=0)  # everything evictable goes; the entry in use stays
    assert pool.entries == [in_use]
    pool.release(in_use)
    _check_entries(pool)
    assert pool.entries[0].tokens.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9]


def test_an_entry_in_use_is_measured_as_it_is_fed_an_idle_one_as_recorded():
    """The budget and the memory line read an idle entry's bytes as its request's end
    recorded them (no walk of its layers, safe from any thread), and one in use as it grows."""
    pool = CachePool(_make_entry, max_entries=2)
    _request(pool, [1, 2, 3, 4], [5])
    (entry,) = pool.entries
    assert entry.recorded is not None and pool.usage().entries[0].footprint.num_tokens == 5
    hit = pool.fetch_nearest([1, 2, 3, 4, 5, 6])  # extended in place: in use
    hit.entry.cache.forward(_IdWriter(), hit.remaining + list(range(7, 20)))
    (measured,) = pool.usage().entries
    assert measured.footprint.num_tokens == 19
    assert measured.footprint.allocated_bytes == entry.cache.footprint().allocated_bytes
    pool.release(hit.entry)
    assert pool.usage().entries[0].footprint == entry.recorded[0]
    _check_entries(pool)


def test_an_entry_restored_from_disk_for_part_of_it_is_used_in_place_and_recorded(tmp_path):
    """A request sharing part of a file: the restore (streamed, its layers checked while the
    request runs) is rewound to the shared part and used in place, never copied (a copy
    would wait for every check); its bytes recorded like any other entry's."""
    store = DiskStore(tmp_path, fingerprint="f", signature="s", max_bytes=2**30, trimmable=True)
    pool = CachePool(_make_entry, max_entries=3, store=store)
    _request(pool, list(range(1, 11)), [11, 12])
    pool.persist()
    pool.clear()
    hit = _request(pool, [1, 2, 3, 4, 5, 6, 99, 98])
    assert len(hit.remaining) == 2  # the six shared tokens came from disk
    assert [e.tokens.tolist() for e in pool.entries] == [[1, 2, 3, 4, 5, 6, 99, 98]]
    _check_entries(pool)
    store.close()  # each request's entry was written behind: stop the writer thread


def test_a_copy_from_an_entry_in_use_follows_what_its_cache_holds_now():
    """Its request may have shifted it (a context shift drops tokens mid-window): a copy of
    the recorded prefix would then be other tokens' K/V."""
    pool = CachePool(_make_entry, max_entries=2)
    _request(pool, [1, 2, 3, 4, 5, 6])
    first = pool.fetch_nearest([1, 2, 3, 4, 5, 6, 7])
    in_use = first.entry
    in_use.cache.trim_to(2)  # as if shifted: it holds [1, 2, 8, 9] now
    first.entry.cache.forward(_IdWriter(), [8, 9])
    second = pool.fetch_nearest([1, 2, 3, 4, 5, 6, 10])
    assert second.num_cached == 2
    second.entry.cache.forward(_IdWriter(), second.remaining)
    pool.release(second.entry)
    pool.release(in_use)
    _check_entries(pool)


def _make_windowed_entry() -> ModelCache:
    """Layers of which one cannot always trim back (a sliding window): it needs checkpoints."""

    def make_layers():
        return [KVCache(step=4), SlidingWindowCache(window=64)]

    return ModelCache(make_layers(), make_layers)


@pytest.mark.parametrize(
    ("make_entry", "max_entries", "cached", "expected"),
    [
        (_make_windowed_entry, 2, [], (3, 8)),
        (_make_windowed_entry, 1, [], (8,)),
        (_make_windowed_entry, 2, [1, 2, 3, 4, 5], (3,)),  # keep is cached; reply 8 - 5
        (_make_entry, 2, [], ()),  # every layer trims back
    ],
)
def test_a_fill_checkpoints_where_the_reply_starts_and_with_several_entries_the_kept_prefix(
    make_entry, max_entries, cached, expected
):
    """Layers that cannot trim back return only to checkpoints: the pool asks for one where
    the reply starts (the next turn goes back there) and, when another conversation may copy
    it, where the kept system prompt ends; in tokens after those reused."""
    pool = CachePool(make_entry, max_entries=max_entries)
    if cached:
        _request(pool, cached)
    hit = pool.fetch_nearest(list(range(1, 13)), reply_start=8, keep=3)
    assert hit.num_cached == len(cached)
    assert hit.checkpoints == expected


def test_a_conversation_that_went_on_in_a_copy_of_its_entry_in_use_is_held_once():
    """The chat page's Stop then send: the next turn arrives while the stopped request still
    generates into its entry, and copies its prefix past the reply start (the same
    conversation). Had the entry been free it would have been trimmed in place; released, it
    goes, so the pool holds that conversation's K/V once (one entry, one panel row)."""
    pool = CachePool(_make_entry, max_entries=4)
    prompt = [7, 7, 1, 1]
    stopped = pool.fetch_nearest(prompt, reply_start=3)
    stopped.entry.cache.forward(_IdWriter(), stopped.remaining + [5, 5])  # the reply so far
    went_on = pool.fetch_nearest(prompt + [5, 5, 9, 2], reply_start=7)  # the next turn
    assert went_on.entry is not stopped.entry and went_on.num_cached == 6
    stopped.entry.cache.forward(_IdWriter(), [5, 6])  # generated before the cancel landed
    pool.release(stopped.entry)
    went_on.entry.cache.forward(_IdWriter(), went_on.remaining + [3])
    pool.release(went_on.entry)
    assert [e.tokens.tolist() for e in pool.entries] == [prompt + [5, 5, 9, 2, 3]]
    assert pool.nbytes == went_on.entry.cache.footprint().allocated_bytes
    _check_entries(pool)


def test_another_conversation_copied_from_an_entry_in_use_keeps_both():
    """A copy before the entry's reply start is another conversation (a shared system
    prompt): both stay."""
    pool = CachePool(_make_entry, max_entries=4)
    first = pool.fetch_nearest([7, 7, 1, 1], reply_start=3)
    first.entry.cache.forward(_IdWriter(), first.remaining + [5])
    other = _request(pool, [7, 7, 2, 2], [6], reply_start=3)
    assert other.num_cached == 2
    pool.release(first.entry)
    held = sorted(e.tokens.tolist() for e in pool.entries)
    assert held == [[7, 7, 1, 1, 5], [7, 7, 2, 2, 6]]
    _check_entries(pool)


def test_two_requests_with_one_prompt_at_once_keep_both_replies():
    """The second copies the first's entry in use short of its prompt's end (a prompt leaves
    one token to feed): not the same conversation going on, so the first's entry, holding the
    reply its client sends back, stays when its request ends after the second's."""
    pool = CachePool(_make_entry, max_entries=4)
    prompt = [7, 7, 1, 1]
    first = pool.fetch_nearest(prompt, reply_start=3)
    first.entry.cache.forward(_IdWriter(), first.remaining + [5])
    second = _request(pool, prompt, [6], reply_start=3)
    assert second.num_cached == 3
    first.entry.cache.forward(_IdWriter(), [5, 5])
    pool.release(first.entry)
    held = sorted(e.tokens.tolist() for e in pool.entries)
    assert held == [[7, 7, 1, 1, 5, 5, 5], [7, 7, 1, 1, 6]]
    _check_entries(pool)


@pytest.mark.parametrize("max_entries", [1, 4])
def test_a_deleted_conversation_frees_only_entries_its_own_key_last_took(max_entries):
    """A client sending no key that goes on from (or trims in place) an entry the page's
    conversation labelled keeps it when the page deletes that conversation; the page's own
    entry, its last request keyed, is freed."""
    pool = CachePool(_make_entry, max_entries=max_entries)
    hit = pool.fetch_nearest([1, 2, 3, 4], reply_start=4, label="chatA")
    hit.entry.cache.forward(_IdWriter(), [*hit.remaining, 5])
    pool.release(hit.entry)
    other = [1, 2, 3, 4, 5, 6, 7] if max_entries == 4 else [1, 2, 8, 8]
    hit = pool.fetch_nearest(other, reply_start=len(other), label=None)
    hit.entry.cache.forward(_IdWriter(), [*hit.remaining, 9])
    pool.release(hit.entry)
    assert pool.drop_labelled("chatA") == 0
    assert [e.tokens.tolist()[: len(other)] for e in pool.entries] == [other]
    hit = pool.fetch_nearest([5, 5, 5], reply_start=3, label="chatB")
    hit.entry.cache.forward(_IdWriter(), [*hit.remaining, 1])
    pool.release(hit.entry)
    assert pool.drop_labelled("chatB") == 1
