"""The chat page's Stop then send on a Runner: the next turn arrives while the stopped reply
still decodes (its cancel has not reached it yet), so that turn copies the entry in use; once
the stopped reply ends, the conversation is one entry (its K/V held once), and the next turn's
reply equals a fresh Runner's for the same messages."""

from __future__ import annotations

import threading

import pytest

from mlxkv import Runner
from tests.factories import joined
from tests.tolerances import LOGPROB_ABS, logprob_rel

QUESTION = [{"role": "user", "content": "Once upon a time there was"}]
OPTIONS = {"temperature": 0.0, "logprobs": 0}


def _tokens_and_logprobs(chunks) -> tuple[list[int], list[float]]:
    chunks = list(chunks)
    tokens = [c.token for c in chunks if c.token is not None]
    return tokens, [c.logprob.logprob for c in chunks if c.logprob is not None]


def test_a_turn_sent_while_its_stopped_reply_still_decodes_leaves_one_entry(loaded_tiny):
    loaded = loaded_tiny("llama")
    runner = Runner(loaded, max_context=512, cache_entries=4, max_batch=4, speculative=None)
    stopped = runner.stream(QUESTION, batched=True, max_tokens=400, **OPTIONS)
    shown = "".join(next(stopped).text for _ in range(3))  # what the page shows at Stop
    messages = [
        *QUESTION,
        {"role": "assistant", "content": shown},
        {"role": "user", "content": "Go on."},
    ]
    started = threading.Event()
    got: list = []

    def send() -> None:  # the next turn, on the page's next request
        def chunks():
            for chunk in runner.stream(messages, batched=True, max_tokens=8, **OPTIONS):
                started.set()
                yield chunk

        got.append(_tokens_and_logprobs(chunks()))

    sender = threading.Thread(target=send)
    sender.start()
    for chunk in stopped:  # decoding on until the next turn has its first token
        assert chunk.finish_reason is None, "the stopped reply ended before the next turn came"
        if started.is_set():
            break
    stopped.close()  # the cancel lands
    joined(sender)
    (entry,) = runner.cache_info().entries  # before: the stopped reply's entry stayed too
    fresh = Runner(loaded, max_context=512, speculative=None)
    want_tokens, want_logprobs = _tokens_and_logprobs(
        fresh.stream(messages, max_tokens=8, **OPTIONS)
    )
    ((tokens, logprobs),) = got
    assert tokens == want_tokens
    assert logprobs == pytest.approx(want_logprobs, abs=LOGPROB_ABS, rel=logprob_rel(None))
    assert entry.num_tokens >= fresh.cache_info().entries[0].num_tokens - 1
