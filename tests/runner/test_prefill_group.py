"""The prefill group's coordination, driven by hand as the engine thread runs it: a member
pauses (once) only while others are about to come; the last to come, or the first to
resume, feeds every member in one pass; a member closed while paused is left out; an error
reaches every member and changes no cache; a member alone feeds itself."""

from __future__ import annotations

import pytest

from mlxkv.cache.building import make_cache
from mlxkv.decoding.pause import PAUSE
from mlxkv.decoding.prefill.chunks import PrefillPlan, fill, prefill
from mlxkv.runner.prefill import group as group_module
from mlxkv.runner.prefill.group import PrefillGroup
from tests.factories import recorded
from tests.tolerances import assert_logits_close

PLAN = PrefillPlan(512)
HELD = [[], [3, 4, 5], [9] * 7]
PROMPTS = [[5, 9, 13, 2], [1], list(range(30, 41))]


class _Arrivals:
    """What the engine thread says of first jobs queued, set by the test."""

    def __init__(self):
        self.waiting = False

    def __call__(self) -> bool:
        return self.waiting


@pytest.fixture
def model(loaded_tiny):
    return loaded_tiny("llama").model


@pytest.fixture
def passes(monkeypatch):
    """The rows of every batched pass the group runs."""
    return recorded(
        monkeypatch, group_module, "prefill_together", lambda _model, caches, _p, **_: len(caches)
    )


def _group(model, arrivals, max_rows=4):
    return PrefillGroup(model, max_prompt_tokens=64, max_rows=max_rows, queued=arrivals)


def _caches(model):
    caches = [make_cache(model) for _ in HELD]
    for cache, held in zip(caches, HELD, strict=True):
        if held:
            fill(model, cache, held, PLAN)
    return caches


def _result(generator):
    """The value `generator` returns, run to its end; fails if it pauses again."""
    with pytest.raises(StopIteration) as end:
        next(generator)
    return end.value.value


def _assert_as_alone(model, i, cache, logits):
    alone = make_cache(model)
    if HELD[i]:
        fill(model, alone, HELD[i], PLAN)
    assert_logits_close(logits, prefill(model, alone, PROMPTS[i], PLAN), f"member {i}")
    assert cache.tokens == HELD[i] + PROMPTS[i]


def test_the_last_to_come_feeds_every_member_in_one_pass(model, passes):
    arrivals = _Arrivals()
    group, caches = _group(model, arrivals), _caches(model)
    arrivals.waiting = True
    paused = [group.prefill(caches[i], PROMPTS[i]) for i in (0, 1)]
    for member in paused:
        assert next(member) is PAUSE  # paused: others are coming
    arrivals.waiting = False
    last = _result(group.prefill(caches[2], PROMPTS[2]))
    assert passes == [3]
    logits = [_result(member) for member in paused] + [last]
    for i, cache in enumerate(caches):
        _assert_as_alone(model, i, cache, logits[i])


def test_the_first_to_resume_feeds_the_members_so_far(model, passes):
    """The requests coming did not join (a long prompt, say): the first member to resume
    feeds those there, pausing no second time."""
    arrivals = _Arrivals()
    group, caches = _group(model, arrivals), _caches(model)
    arrivals.waiting = True
    first, second = (group.prefill(caches[i], PROMPTS[i]) for i in (0, 1))
    assert next(first) is PAUSE and next(second) is PAUSE
    logits = [_result(first), _result(second)]
    assert passes == [2]
    for i in (0, 1):
        _assert_as_alone(model, i, caches[i], logits[i])


def test_a_member_alone_feeds_itself(model, passes):
    arrivals = _Arrivals()
    group, caches = _group(model, arrivals), _caches(model)
    assert _result(group.prefill(caches[0], PROMPTS[0])) is None  # nobody coming: no pause
    arrivals.waiting = True
    member = group.prefill(caches[1], PROMPTS[1])
    assert next(member) is PAUSE
    assert _result(member) is None  # nobody came after all
    assert passes == [] and [c.tokens for c in caches] == HELD


def test_a_member_closed_while_paused_is_left_out(model, passes):
    arrivals = _Arrivals()
    group, caches = _group(model, arrivals), _caches(model)
    arrivals.waiting = True
    members = [group.prefill(caches[i], PROMPTS[i]) for i in range(3)]
    for member in members:
        assert next(member) is PAUSE
    members[1].close()  # its client went away
    logits = [_result(members[0]), _result(members[2])]
    assert passes == [2] and caches[1].tokens == HELD[1]
    _assert_as_alone(model, 0, caches[0], logits[0])
    _assert_as_alone(model, 2, caches[2], logits[1])


def test_rows_of_very_different_lengths_are_not_padded_to_each_other(model, passes):
    """A member whose cache holds 300 tokens beside two short ones: the short ones are fed
    together; the long one feeds alone (its row would pad theirs to 300 tokens)."""
    arrivals = _Arrivals()
    group, caches = _group(model, arrivals), _caches(model)
    long_cache = make_cache(model)
    fill(model, long_cache, [(7 * i) % 250 + 3 for i in range(300)], PLAN)
    arrivals.waiting = True
    paused = [group.prefill(long_cache, [5, 6]), group.prefill(caches[0], PROMPTS[0])]
    for member in paused:
        assert next(member) is PAUSE
    arrivals.waiting = False
    last = _result(group.prefill(caches[1], PROMPTS[1]))
    assert passes == [2]
    assert _result(paused[0]) is None and long_cache.num_tokens == 300  # left to feed alone
    _assert_as_alone(model, 0, caches[0], _result(paused[1]))
    _assert_as_alone(model, 1, caches[1], last)


def test_requests_waiting_for_a_shared_prefix_are_waited_for(model, passes):
    group, caches = _group(model, _Arrivals()), _caches(model)
    with group.arriving():
        member = group.prefill(caches[0], PROMPTS[0])
        assert next(member) is PAUSE
    logits = _result(group.prefill(caches[1], PROMPTS[1]))
    assert passes == [2]
    _assert_as_alone(model, 1, caches[1], logits)
    _assert_as_alone(model, 0, caches[0], _result(member))


def test_a_full_group_waits_for_no_one(model, passes):
    arrivals = _Arrivals()
    group, caches = _group(model, arrivals, max_rows=2), _caches(model)
    arrivals.waiting = True
    first = group.prefill(caches[0], PROMPTS[0])
    assert next(first) is PAUSE
    _result(group.prefill(caches[1], PROMPTS[1]))  # the second of two rows: no pause
    assert passes == [2]
    _result(first)


def test_a_failed_pass_reaches_every_member_and_changes_no_cache(model, monkeypatch):
    def broken(*args, **_):
        raise RuntimeError("broken pass")

    monkeypatch.setattr(group_module, "prefill_together", broken)
    arrivals = _Arrivals()
    group, caches = _group(model, arrivals), _caches(model)
    arrivals.waiting = True
    first = group.prefill(caches[0], PROMPTS[0])
    assert next(first) is PAUSE
    arrivals.waiting = False
    with pytest.raises(RuntimeError, match="broken pass"):
        next(group.prefill(caches[1], PROMPTS[1]))
    with pytest.raises(RuntimeError, match="broken pass"):
        next(first)
    assert [c.tokens for c in caches] == HELD


def test_admits_short_prompts_on_caches_that_batch(model, loaded_tiny):
    group = _group(model, _Arrivals())
    assert group.admits(make_cache(model), [1] * 63)
    assert not group.admits(make_cache(model), [1] * 64)  # a whole chunk: fed in turns
    assert not group.admits(make_cache(model), [])
    gemma = loaded_tiny("gemma3_text").model
    assert group.admits(make_cache(gemma), [1, 2])  # windows: their checkpoints sliced out
    assert not group.admits(make_cache(model, kv_bits=8, kv_group_size=32), [1, 2])
    lfm2 = loaded_tiny("lfm2").model
    assert not group.admits(make_cache(lfm2), [1, 2])  # state: only as the probe found
    exact = PrefillGroup(
        model, max_prompt_tokens=64, max_rows=4, queued=_Arrivals(), padded_state_exact=True
    )
    assert exact.admits(make_cache(lfm2), [1, 2])
