"""Review: a client of the real OpenAI client that leaves (closes its stream) while its
request's prompt waits in a batched prefill with three others, on tiny LFM2 and Gemma 3
(text) behind the real server: the three others answer as a fresh Runner alone, nothing stays
in use, the batch is empty, and the left question asked again answers as fresh. Entries are
checked after every request by `tests/invariants.py`. Deterministic: the engine is held until
the four first jobs are queued, and their prompts share no prefix the cache lacks, so the
four are fed in one pass, held until the client has left (never retried, never skipped)."""

from __future__ import annotations

import threading
import time

import pytest

from mlxkv import Runner
from mlxkv.runner.prefill import group as prefill_group
from tests.factories import joined, wait_until
from tests.server.conftest import serve

# Their prompts share only the chat template's opening with one another and with WARM_UP, whose
# turn leaves that opening cached: no request waits for another to feed a prefix they share
# (`request_run._await_shared_prefix`), so all four reach their prefill in one round, whatever
# order they arrive in, and are fed in one pass (the group's rows: max_batch).
QUESTIONS = [
    "Tell me about caches and their keys.",
    "What is a sliding window?",
    "Do recurrent layers keep state?",
    "Count the rows of a batch.",
]
WARM_UP = "Hello there."
LEAVES = 1  # the client that leaves
MAX_TOKENS = 12


def _messages(question):
    return [{"role": "user", "content": question}]


@pytest.mark.parametrize("arch", ["lfm2", "gemma3_text"])
def test_a_client_leaving_during_a_batched_prefill(loaded_tiny, arch, monkeypatch):
    loaded = loaded_tiny(arch)
    fresh = Runner(loaded, max_context=1024, speculative=None)
    want = [
        fresh.generate(_messages(q), max_tokens=MAX_TOKENS, temperature=0.0).text for q in QUESTIONS
    ]
    prompts = [fresh.encode(_messages(q)) for q in [*QUESTIONS, WARM_UP]]
    shared = {_common_prefix(a, b) for a in prompts for b in prompts if a is not b}
    assert len(shared) == 1, f"the prompts share prefixes of {sorted(shared)} tokens"
    passes = _leave_during_the_pass(loaded, want, monkeypatch)
    assert passes[0] == (len(QUESTIONS), True, True), passes


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def _leave_during_the_pass(loaded, want, monkeypatch) -> list[tuple[int, bool, bool]]:
    """The four requests with every check made; returns each batched prefill pass as (rows,
    whether a client had left when it ran, whether the leaving client's prompt was in it)."""
    runner = Runner(loaded, max_context=1024, max_batch=len(QUESTIONS), cache_entries=8)
    original = prefill_group.prefill_together
    passes: list[tuple[int, bool, bool]] = []
    leaving = list(runner.encode(_messages(QUESTIONS[LEAVES])))
    leave_now = threading.Event()  # the pass is about to run: the client leaves

    def a_client_left() -> bool:
        return any(event.is_set() for event in list(runner._dispatch._requests))

    def held_until_a_client_left(*args, **kwargs):
        leave_now.set()
        # until the server saw the client leave; the bound only keeps a broken leave from
        # hanging the engine (the others' clients read for 60 s), said by `left` below
        tick, deadline = threading.Event(), time.monotonic() + 30
        while not a_client_left() and time.monotonic() < deadline:
            tick.wait(0.01)
        left = a_client_left()
        member = any(leaving[-len(p) :] == list(p) for p in args[2])  # its prompt is fed
        passes.append((len(args[2]), left, member))
        return original(*args, **kwargs)

    monkeypatch.setattr(prefill_group, "prefill_together", held_until_a_client_left)
    got: list = [None] * len(QUESTIONS)
    with serve(runner, model_name="tiny") as served:
        served.openai().chat.completions.create(
            model="tiny", messages=_messages(WARM_UP), max_tokens=1, temperature=0.0
        )
        # its reply came with its last chunk; its stream ends (its place in the batch freed)
        # on the engine after it: held before that, the fourth question would find no place
        wait_until(lambda: runner._dispatch._slots.taken == 0, what="the warm-up's place freed")
        # the engine held until every first job is queued, so that their prompts are fed together
        holding, gate = threading.Event(), threading.Event()
        runner._engine._submit(lambda: (holding.set(), gate.wait(30)))
        assert holding.wait(30)

        def ask(i):
            stream = served.openai(timeout=60).chat.completions.create(
                model="tiny",
                messages=_messages(QUESTIONS[i]),
                max_tokens=MAX_TOKENS,
                temperature=0.0,
                stream=True,
            )  # its headers come at once: the stream is open while the engine is held
            if i == LEAVES:
                assert leave_now.wait(60), "no batched pass ran"
                stream.close()  # gone while its prompt waits in the pass
                got[i] = "left"
                return
            got[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(QUESTIONS))]
        for thread in threads:
            thread.start()
        wait_until(lambda: len(runner._engine._urgent) == len(QUESTIONS), what="jobs queued")
        gate.set()
        joined(*threads, timeout_s=120)
        monkeypatch.setattr(prefill_group, "prefill_together", original)
        for i, text in enumerate(got):
            if i != LEAVES:
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
    return passes
