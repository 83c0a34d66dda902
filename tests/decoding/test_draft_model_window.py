"""A draft model past the window: when the target makes room (a shift in place, or its kept
tokens prefilled again), the draft model's text and cache follow what the target keeps, so
drafting goes on after the room is made. The target's output is plain decoding's (a fresh
Runner with speculation off): greedy tokens equal and log-probabilities within
`LOGPROB_ABS`, across every point where the window makes room."""

from __future__ import annotations

import dataclasses

import pytest

from mlxkv import Runner
from mlxkv.cache.prefix import common_prefix_length
from mlxkv.decoding import speculative
from mlxkv.decoding.speculative import DraftLength
from mlxkv.runner.context import ContextWindow
from tests.tolerances import LOGPROB_ABS

# a full-attention model (shifted in place), a window model and a hybrid (both reprocessed)
ARCHS = ["llama", "gemma3_text", "lfm2"]
MESSAGES = [{"role": "user", "content": "Count the colors: red blue green red blue green."}]
ROOM_TOKENS = 8  # the window: the prompt and this many tokens, so a long reply makes room often
MAX_TOKENS = 96


@dataclasses.dataclass
class _Record:
    """Each time the window made room, and each verification: how many drafts it accepted."""

    rooms: int = 0
    accepted_after_rooms: list[int] = dataclasses.field(default_factory=list)

    def accepted_after(self, rooms: int) -> int:
        return sum(self.accepted_after_rooms[rooms:])


@pytest.fixture
def record(monkeypatch):
    """Counts the times the target's window made room, and the drafts accepted after each."""
    seen = _Record()
    make_room, verify = ContextWindow.make_room, speculative._verify

    def counted_make_room(self, cache, num_new):
        held = cache.num_tokens
        made = make_room(self, cache, num_new)
        seen.rooms += cache.num_tokens < held
        return made

    def counted_verify(model, cache, token, draft, *args):
        new = verify(model, cache, token, draft, *args)
        while len(seen.accepted_after_rooms) <= seen.rooms:
            seen.accepted_after_rooms.append(0)
        seen.accepted_after_rooms[seen.rooms] += len(new) - 1
        return new

    monkeypatch.setattr(ContextWindow, "make_room", counted_make_room)
    monkeypatch.setattr(speculative, "_verify", counted_verify)
    return seen


def _window(loaded) -> int:
    return len(Runner(loaded).encode(MESSAGES)) + ROOM_TOKENS


@pytest.mark.parametrize("arch", ARCHS)
def test_a_reply_past_the_window_drafts_after_each_room_made_and_equals_plain(
    loaded_tiny, arch, record
):
    """The model as its own draft model (every greedy draft right): the reply makes room
    several times, at the tokens plain decoding makes it, drafts are accepted after the last
    time (before, drafting stopped for good once the text passed the window and
    `DraftLength.MAX_TOKENS`), every draft is accepted (the draft cache is the target's, also
    where it was shifted in place), and every token and log-probability is plain decoding's."""
    loaded = loaded_tiny(arch)
    options = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": 0}
    plain = Runner(loaded, max_context=_window(loaded), speculative=None)
    want_chunks = list(plain.stream(MESSAGES, **options))
    want = want_chunks[-1].completion
    plain_rooms, record.rooms = record.rooms, 0
    assert len(want.tokens) == MAX_TOKENS and plain_rooms >= 3, "too short a reply"
    drafted = Runner(loaded, max_context=_window(loaded), draft=dataclasses.replace(loaded))
    chunks = list(drafted.stream(MESSAGES, speculative="draft", **options))
    got = chunks[-1].completion
    assert got.tokens == want.tokens
    assert [c.logprob.logprob for c in chunks[:-1]] == pytest.approx(
        [c.logprob.logprob for c in want_chunks[:-1]], abs=LOGPROB_ABS
    )
    assert record.rooms == plain_rooms  # room made at the same tokens as plain decoding's
    assert record.accepted_after(record.rooms) > 0, record  # drafts after the last room made
    assert got.accepted_tokens == got.drafted_tokens
    _assert_draft_cache_follows(drafted)


def test_a_sampled_reply_past_the_window_with_a_draft_model_is_a_seeded_run(loaded_tiny, record):
    """Temperature 0.8, seeded, the model as its own draft model (sampled drafts, accepted
    with probability min(1, p/q) ~ 1): the reply passes the window with drafts accepted after
    it, the same seed gives the same reply, every token is one the model can pick, and the
    draft cache holds the target's kept text."""
    loaded = loaded_tiny("llama")
    options = {"max_tokens": MAX_TOKENS, "temperature": 0.8, "seed": 11}

    def reply():
        runner = Runner(loaded, max_context=_window(loaded), draft=dataclasses.replace(loaded))
        return runner, runner.generate(MESSAGES, speculative="draft", **options)

    runner, first = reply()
    assert record.rooms >= 3 and record.accepted_after(record.rooms) > 0, record
    assert first.accepted_tokens > first.drafted_tokens // 2
    assert all(0 <= t < loaded.vocab_size for t in first.tokens)
    _assert_draft_cache_follows(runner)
    assert reply()[1].tokens == first.tokens


def _assert_draft_cache_follows(runner: Runner) -> None:
    """The draft cache holds the target cache's kept text (less the tokens drafting feeds
    ahead of it), not the text before the room was made."""
    (entry,) = runner._pool.entries
    held = entry.cache.tokens
    shared = common_prefix_length(entry.draft_cache.tokens, held)
    assert shared >= len(held) - DraftLength.MAX_TOKENS - 1, (shared, len(held))
