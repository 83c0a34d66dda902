"""Review probe of batched windows and recurrent state (merge fd1e4a3) through the real server
and the real OpenAI client: four concurrent chats on tiny LFM2 and Gemma 3 (text), two of them
left mid-stream, each answering as a fresh Runner answers it alone; afterwards nothing in use,
an empty batch, and the left conversations' next turns as a fresh Runner's. Entries are checked
after every request by `tests/invariants.py`."""

from __future__ import annotations

import threading

import pytest

from mlxkv import Runner
from mlxkv.decoding import batch as batch_module
from tests.factories import joined, read_in_step, wait_until
from tests.server.conftest import held_until_left, serve
from tests.tolerances import LOGPROB_ABS

ASKS = [  # (question, max_tokens, chunks read before leaving, or None)
    ("Tell me about caches and their keys.", 30, None),
    ("What is a sliding window?", 40, 3),
    ("Why do recurrent layers keep state?", 26, None),
    ("Count the rows of a batch, at length.", 60, 9),
]


@pytest.mark.parametrize("arch", ["lfm2", "gemma3_text"])
def test_concurrent_chats_with_disconnects_answer_as_alone(loaded_tiny, arch, monkeypatch):
    loaded = loaded_tiny(arch)
    rows: list[int] = []
    step = batch_module.DecodeBatch._step

    def counting(self):
        rows.append(self.num_rows)
        return step(self)

    def alone(question, n):
        fresh = Runner(loaded, max_context=1024, speculative=None)
        messages = [{"role": "user", "content": question}]
        chunks = list(fresh.stream(messages, max_tokens=n, temperature=0.0, logprobs=0))
        return chunks[-1].completion.text, [c.logprob.logprob for c in chunks if c.logprob]

    want = [alone(q, n) for q, n, _ in ASKS]
    runner = Runner(loaded, max_context=1024, max_batch=4)
    monkeypatch.setattr(batch_module.DecodeBatch, "_step", counting)
    # the server's worker reads each stream: all four decode in one step before any third
    # chunk, and the two leaving ones wait for their clients to leave
    read_in_step(monkeypatch, runner, len(ASKS))
    leaves_after = {n: leave_after for _, n, leave_after in ASKS}
    held_until_left(monkeypatch, runner, lambda options: leaves_after.get(options["max_tokens"]))
    got: list = [None] * len(ASKS)
    with serve(runner, model_name="tiny") as served:
        client = served.openai()

        def ask(i):
            question, n, leave_after = ASKS[i]
            messages = [{"role": "user", "content": question}]
            stream = client.chat.completions.create(
                model="tiny",
                messages=messages,
                max_tokens=n,
                temperature=0.0,
                stream=True,
                logprobs=True,
            )
            pieces, logprobs = [], []
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    pieces.append(chunk.choices[0].delta.content)
                if chunk.choices and chunk.choices[0].logprobs:
                    logprobs += [t.logprob for t in chunk.choices[0].logprobs.content]
                if leave_after is not None and len(pieces) == leave_after:
                    stream.close()
                    break
            got[i] = "".join(pieces), logprobs

        threads = [threading.Thread(target=lambda i=i: ask(i)) for i in range(len(ASKS))]
        for thread in threads:
            thread.start()
        joined(*threads, timeout_s=120)
        for i, (_, _, leave_after) in enumerate(ASKS):
            (text, logprobs), (want_text, want_logprobs) = got[i], want[i]
            if leave_after is None:
                assert text == want_text and len(logprobs) == len(want_logprobs), i
            else:
                assert want_text.startswith(text) and 0 < len(logprobs) < len(want_logprobs), i
            assert logprobs == pytest.approx(want_logprobs[: len(logprobs)], abs=LOGPROB_ABS), i
        wait_until(lambda: not runner._pool._in_use, what="every entry released")
        assert runner._dispatch._batching.batch.num_rows == 0
        assert runner._dispatch._batching.streams == 0
        for i in (1, 3):  # the left conversations, with what their clients saw, go on
            question = ASKS[i][0]
            messages = [
                {"role": "user", "content": question},
                {"role": "assistant", "content": got[i][0]},
                {"role": "user", "content": "Go on."},
            ]
            again = client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=16, temperature=0.0
            )
            fresh = Runner(loaded, max_context=1024, speculative=None)
            expected = fresh.generate(messages, max_tokens=16, temperature=0.0).text
            assert again.choices[0].message.content == expected, i
    assert min(len(logprobs) for _, logprobs in want) >= 2  # each decodes past its first
    assert max(rows) == len(ASKS), rows
