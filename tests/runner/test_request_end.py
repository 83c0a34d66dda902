"""A request's entry is claimed and released in one place (`run_request`), before its last
chunk reaches the caller, and the public end-of-request hook (`mlxkv.runner.hooks`) tells
observers what it fed."""

import pytest

from mlxkv.runner.hooks import request_ends


@pytest.mark.parametrize("batched", [False, True], ids=["alone", "batched"])
def test_the_entry_is_released_before_the_last_chunk_is_handed_out(make_runner, batched):
    runner = make_runner("llama", cache_entries=2)
    pool = runner._pool
    in_use_at_last_chunk = None
    for chunk in runner.stream("The quick brown fox", max_tokens=5, batched=batched):
        if chunk.completion is not None:
            in_use_at_last_chunk = len(pool._in_use)
        else:
            assert len(pool._in_use) == 1, "the entry is held while the request streams"
    assert in_use_at_last_chunk == 0


def test_observers_hear_each_end_with_what_it_fed_while_registered(make_runner):
    runner = make_runner("llama")
    ends = []
    with request_ends(ends.append):
        out = runner.generate("The quick brown fox", max_tokens=5, temperature=0)
        runner.generate("The quick brown fox jumps", max_tokens=3, temperature=0)
    runner.generate("Not heard", max_tokens=2)
    assert len(ends) == 2
    first = ends[0]
    assert first.prompt == runner.encode("The quick brown fox")
    assert first.generated == out.tokens
    assert first.entry.tokens.tolist()[: len(first.prompt)] == first.prompt
    assert first.context.config.max_context == runner.max_context


def test_an_observer_that_raises_fails_that_request_and_leaves_the_cache_consistent(make_runner):
    runner = make_runner("llama")

    def broken(_end):
        raise RuntimeError("observer failed")

    with request_ends(broken), pytest.raises(RuntimeError, match="observer failed"):
        runner.generate("The quick brown fox", max_tokens=3)
    assert runner._pool._in_use == {}
    again = runner.generate("The quick brown fox", max_tokens=3)
    assert again.cached_tokens > 0
