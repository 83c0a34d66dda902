"""A chat in a small window, turn after turn on one Runner: prompts cut at message boundaries
and replies that pass the window's edge (shifted in place, or the kept tokens prefilled again
for windows and recurrent state), with a kept system prompt, alone or with batched requests
decoding beside it. Each turn equals a fresh Runner fed the token ids the turn kept, with the
same `keep` (issue 6 recheck). A turn whose entry was shifted in place is left out: an
in-place shift keeps K/V computed with the dropped tokens in context
(docs/long-conversations.md)."""

from __future__ import annotations

import threading

import pytest

from mlxkv import Runner
from mlxkv.runner import context as context_module
from mlxkv.runner.hooks import request_ends
from tests.factories import joined
from tests.runner.test_batching import _tokens_and_logprobs
from tests.tolerances import LOGPROB_ABS

WORDS = ["red", "blue", "green", "fox", "dog", "river", "museum", "capital", "seven"]
SYSTEM = {"role": "system", "content": "You count colors and keep it short."}
WINDOW_TOKENS = 128
REPLY_TOKENS = 40  # past the window's edge on most turns
SIDE_REQUESTS = 200  # a bound on the requests beside the chat


@pytest.fixture
def keeps(monkeypatch):
    """The `keep` of every window that made room, in order."""
    seen: list[int] = []
    make_room = context_module.ContextWindow.make_room

    def recorded(self, cache, num_new):
        if cache.num_tokens + num_new > self.max_context:
            seen.append(self.keep)
        return make_room(self, cache, num_new)

    monkeypatch.setattr(context_module.ContextWindow, "make_room", recorded)
    return seen


def _side_requests(runner, stop: threading.Event) -> threading.Thread:
    def run():
        for i in range(SIDE_REQUESTS):
            if stop.is_set():
                return
            list(
                runner.stream(f"side request {i} " + "blue " * (i % 5), batched=True, max_tokens=5)
            )

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.parametrize(
    ("arch", "beside"),
    [("llama", False), ("gemma3_text", False), ("spark2_5", False), ("lfm2", False),
     ("mamba", False), ("lfm2", True), ("gemma3_text", True)],
    ids=["llama", "gemma3_text", "spark2_5", "lfm2", "mamba", "lfm2-beside", "gemma3_text-beside"],
)  # fmt: skip
def test_each_turn_equals_a_fresh_runner_fed_what_it_kept(loaded_tiny, keeps, arch, beside):
    loaded = loaded_tiny(arch)
    runner = Runner(loaded, max_context=WINDOW_TOKENS, cache_entries=4, max_batch=4)
    stop = threading.Event()
    side = _side_requests(runner, stop) if beside else None
    messages, compared = [SYSTEM], 0
    try:
        for turn in range(10):
            words = [WORDS[(turn + k) % len(WORDS)] for k in range(turn % 4 + 3)]
            messages.append({"role": "user", "content": " ".join(words)})
            ends: list = []
            options = {"max_tokens": REPLY_TOKENS, "temperature": 0.0, "logprobs": 0}
            with request_ends(ends.append):
                chunks = list(runner.stream(messages, batched=beside, **options))
            completion = chunks[-1].completion
            (end,) = [e for e in ends if e.generated == completion.tokens]
            messages.append({"role": "assistant", "content": completion.text})
            if end.entry.cache.shifted:
                continue
            keep = keeps[-1] if keeps else 4
            fresh = Runner(loaded, max_context=WINDOW_TOKENS, keep=keep, speculative=None)
            want = _tokens_and_logprobs(fresh.stream(list(end.prompt), **options))
            got = _tokens_and_logprobs(chunks)
            assert got[0] == want[0], f"turn {turn}"
            assert got[1] == pytest.approx(want[1], abs=LOGPROB_ABS, rel=1e-4), f"turn {turn}"
            compared += 1
    finally:
        stop.set()
        if side is not None:
            joined(side, timeout_s=120)
    assert compared >= 3
    assert keeps, "no reply reached the window's edge"
