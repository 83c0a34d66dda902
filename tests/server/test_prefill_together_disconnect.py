"""Review: a client of the real OpenAI client that leaves (its read times out) while its
request's prompt waits in a batched prefill with three others, on tiny LFM2 and Gemma 3
(text) behind the real server: the three others answer as a fresh Runner alone, nothing stays
in use, the batch is empty, and the left question asked again answers as fresh. Entries are
checked after every request by `tests/invariants.py`."""

from __future__ import annotations

import threading
import time

import openai
import pytest

from mlxkv import Runner
from mlxkv.runner.prefill import group as prefill_group
from tests.factories import wait_until
from tests.server.conftest import serve

QUESTIONS = [
    "Tell me about caches and their keys.",
    "What is a sliding window?",
    "Why do recurrent layers keep state?",
    "Count the rows of a batch.",
]
LEAVES = 1  # the client that leaves
MAX_TOKENS = 12


def _messages(question):
    return [{"role": "user", "content": question}]


ATTEMPTS = 6  # which prompts the group feeds together depends on arrival order


@pytest.mark.parametrize("arch", ["lfm2", "gemma3_text"])
def test_a_client_leaving_during_a_batched_prefill(loaded_tiny, arch, monkeypatch):
    loaded = loaded_tiny(arch)
    fresh = Runner(loaded, max_context=1024, speculative=None)
    want = [
        fresh.generate(_messages(q), max_tokens=MAX_TOKENS, temperature=0.0).text for q in QUESTIONS
    ]
    for _ in range(ATTEMPTS):
        if _attempt(loaded, want, monkeypatch):
            return
    pytest.skip(f"the leaving client's prompt was fed alone in all {ATTEMPTS} attempts")


def _attempt(loaded, want, monkeypatch) -> bool:
    """One round (every check made); True when the leaving client's prompt was in a batched
    pass when it left."""
    runner = Runner(loaded, max_context=1024, max_batch=4, cache_entries=8)
    original = prefill_group.prefill_together
    passes: list[tuple[int, bool, bool]] = []
    leaving = list(runner.encode(_messages(QUESTIONS[LEAVES])))

    def held_until_a_client_left(*args, **kwargs):
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline and not any(
            event.is_set() for event in list(runner._dispatch._requests)
        ):
            time.sleep(0.02)
        left = any(event.is_set() for event in list(runner._dispatch._requests))
        member = any(leaving[-len(p) :] == list(p) for p in args[2])  # its prompt is fed
        passes.append((len(args[2]), left, member))
        return original(*args, **kwargs)

    monkeypatch.setattr(prefill_group, "prefill_together", held_until_a_client_left)
    got: list = [None] * len(QUESTIONS)
    with serve(runner, model_name="tiny") as served:
        # the engine held until every first job is queued, so that their prompts are fed together
        holding, gate = threading.Event(), threading.Event()
        runner._engine._submit(lambda: (holding.set(), gate.wait(30)))
        assert holding.wait(30)

        def ask(i):
            client = served.openai(timeout=1.5 if i == LEAVES else 60)
            try:
                stream = client.chat.completions.create(
                    model="tiny",
                    messages=_messages(QUESTIONS[i]),
                    max_tokens=MAX_TOKENS,
                    temperature=0.0,
                    stream=True,
                )
                got[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            except openai.APITimeoutError:
                got[i] = "left"

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(QUESTIONS))]
        for thread in threads:
            thread.start()
        wait_until(lambda: len(runner._engine._urgent) == len(QUESTIONS), what="jobs queued")
        gate.set()
        for thread in threads:
            thread.join(120)
        monkeypatch.setattr(prefill_group, "prefill_together", original)
        left = got[LEAVES] == "left"  # else it had its first chunk in time: it stayed
        for i, text in enumerate(got):
            if i != LEAVES or not left:
                assert text == want[i], i
        wait_until(lambda: not runner._pool._in_use, what="every entry released")
        assert runner._dispatch._batching.batch.num_rows == 0
        assert runner._dispatch._batching.streams == 0
        client = served.openai()
        again = client.chat.completions.create(
            model="tiny", messages=_messages(QUESTIONS[LEAVES]), max_tokens=MAX_TOKENS,
            temperature=0.0,
        )  # fmt: skip
        assert again.choices[0].message.content == want[LEAVES]
    return left and any(rows >= 2 and gone and member for rows, gone, member in passes)
