"""A streamed Anthropic reply's `message_start` carries the prompt's usage (input, cache read,
cache creation), as Anthropic's does and as clients read it there (Claude Code's context meter,
older SDKs' final message): the counts of its `message_delta` and of the same turn not
streamed, read through the real `anthropic` client. It still goes out before the prefill ends
(the prefill held on an event until the client has read it)."""

from __future__ import annotations

import threading

import pytest

from mlxkv import Runner
from mlxkv.runner.prefill import fill
from tests.server.conftest import serve

SYSTEM = "You are terse."
QUESTION = [{"role": "user", "content": "Once upon a time there was"}]
PROMPT_FIELDS = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
# How long a held prefill waits for the client to read message_start: only a broken server
# waits this long (the test then fails).
HOLD_S = 20.0


@pytest.fixture(scope="module")
def served(loaded_tiny):
    with serve(Runner(loaded_tiny("llama"), max_context=1024)) as served:
        yield served


def _second_turn(client) -> list[dict]:
    """A first turn's exchange (in the cache now) and a new question."""
    first = client.messages.create(model="m", system=SYSTEM, messages=QUESTION, max_tokens=8)
    return [
        *QUESTION,
        {"role": "assistant", "content": first.content[0].text},
        {"role": "user", "content": "And then?"},
    ]


def _counts(usage) -> dict[str, int]:
    return {name: getattr(usage, name) for name in PROMPT_FIELDS}


@pytest.mark.parametrize("max_tokens", [8, 0], ids=["reply", "prewarm"])
def test_message_start_has_the_counts_of_message_delta_and_of_a_reply_not_streamed(
    served, max_tokens
):
    """Turn 2, its first turn's tokens cached; a pre-warm (`max_tokens: 0`) reports the tokens
    it computed as cache creation, streamed or not."""
    client = served.anthropic()
    served.runner.reset()
    messages = _second_turn(client)
    turn = {"model": "m", "system": SYSTEM, "messages": messages, "max_tokens": max_tokens}
    with client.messages.stream(**turn) as stream:
        events = list(stream)
    start = next(e for e in events if e.type == "message_start").message.usage
    delta = next(e for e in events if e.type == "message_delta").usage
    served.runner.reset()  # the same two turns again, the second not streamed
    assert _second_turn(client) == messages
    whole = client.messages.create(**turn)
    assert _counts(start) == _counts(delta) == _counts(whole.usage)
    computed = start.cache_creation_input_tokens if max_tokens == 0 else start.input_tokens
    assert start.cache_read_input_tokens > 0 and computed > 0
    counted = client.messages.count_tokens(model="m", system=SYSTEM, messages=messages)
    assert computed + start.cache_read_input_tokens == counted.input_tokens


def test_message_start_comes_before_the_prefill_ends(served, monkeypatch):
    """The prefill waits for the client to have read message_start: a server that sent it
    only after the prefill (or the first token) would hold the prefill `HOLD_S`."""
    read_start = threading.Event()
    waits: list[bool] = []

    def held(steps):
        def first_chunk_held(*args, **kwargs):
            if not waits:
                waits.append(read_start.wait(HOLD_S))
            return steps(*args, **kwargs)

        return first_chunk_held

    for name in ("fill_steps", "prefill_steps"):  # the model's first prefill chunk
        monkeypatch.setattr(fill, name, held(getattr(fill, name)))
    client = served.anthropic()
    messages = [*QUESTION, {"role": "user", "content": "A long story, please."}]
    with client.messages.stream(model="m", messages=messages, max_tokens=4) as stream:
        for event in stream:
            if event.type == "message_start":
                start = event.message.usage
                read_start.set()
        final = stream.get_final_message()
    assert waits == [True]
    assert _counts(start) == _counts(final.usage)
    assert start.input_tokens > 0
