"""A conversation deleted (`Runner.drop_cache_entries`, the chat page's DELETE) while a request
of it is made but not yet run (`stream()` returned, its first chunk not asked for: a server's
request waiting for the engine or a batch slot) frees that request's entry when it ends, as
the delete frees an entry in use: it acts on every request its key gave before it. A request
given the key after the delete is a new conversation of that key, kept. Each answers as a
fresh Runner does (log-probabilities)."""

from __future__ import annotations

import pytest

from mlxkv import Runner
from tests.runner.test_batching import _tokens_and_logprobs
from tests.tolerances import LOGPROB_ABS

OPTIONS = {"max_tokens": 6, "temperature": 0.0, "logprobs": 0}
DELETED = list(range(3, 30))
LATER = list(range(50, 70))


def _same_as_fresh(got, loaded, prompt: list[int]) -> None:
    want = _tokens_and_logprobs(Runner(loaded, speculative=None).stream(prompt, **OPTIONS))
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=LOGPROB_ABS)


@pytest.mark.parametrize("batched", [False, True], ids=["alone", "batched"])
def test_a_request_made_before_its_key_was_deleted_is_freed_when_it_ends(loaded_tiny, batched):
    loaded = loaded_tiny("llama")
    runner = Runner(loaded, cache_entries=4, speculative=None)
    made = runner.stream(DELETED, cache_key="chat-1", batched=batched, **OPTIONS)
    assert runner.drop_cache_entries("chat-1") == 0  # nothing of it held yet
    _same_as_fresh(_tokens_and_logprobs(made), loaded, DELETED)
    assert runner.cache_info().entries == ()
    assert runner.cached_prefix_tokens(DELETED) == 0

    again = runner.stream(LATER, cache_key="chat-1", batched=batched, **OPTIONS)
    _same_as_fresh(_tokens_and_logprobs(again), loaded, LATER)
    assert [entry.label for entry in runner.cache_info().entries] == ["chat-1"]
    assert runner.drop_cache_entries("chat-1") == 1
