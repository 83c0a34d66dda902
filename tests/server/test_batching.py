"""Eight clients at once through the real `openai` client: every answer equals the one the
same request gets alone, and the requests decoded together. The server's worker reads each
stream on a thread of its own, whatever its client's pace: the streams are read in step over
their first two chunks (`read_in_step`), so that they decode together whatever the threads'
timing."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from mlxkv import Runner
from mlxkv.decoding import batch as batch_module
from tests.factories import read_in_step, wait_until
from tests.server.conftest import held_until_left, held_worker, serve
from tests.tolerances import LOGPROB_ABS

CLIENTS = 8


def _ask(client, i: int) -> tuple[str, list[float]]:
    reply = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": f"Question number {i}: " + "why? " * i}],
        max_tokens=20,
        temperature=0,
        logprobs=True,
    )
    choice = reply.choices[0]
    return choice.message.content, [t.logprob for t in choice.logprobs.content]


def test_eight_concurrent_clients_get_their_sequential_answers(loaded_tiny, monkeypatch):
    rows: list[int] = []
    step = batch_module.DecodeBatch._step
    monkeypatch.setattr(
        batch_module.DecodeBatch, "_step", lambda self: (rows.append(self.num_rows), step(self))
    )
    runner = Runner(loaded_tiny("llama"), max_context=512, cache_entries=16, max_batch=CLIENTS)
    with serve(runner) as served:
        client = served.openai(timeout=120)
        alone = [_ask(client, i) for i in range(CLIENTS)]
        runner.reset()
        rows.clear()
        read_in_step(monkeypatch, runner, CLIENTS)
        with held_worker(served) as release, ThreadPoolExecutor(CLIENTS) as pool:
            futures = [pool.submit(_ask, client, i) for i in range(CLIENTS)]
            worker = served.app.state.mlxkv.worker
            wait_until(lambda: worker._pending == CLIENTS, what="all eight requests queued")
            release.set()
            together = [f.result(120) for f in futures]
    for (text, logprobs), (want_text, want_logprobs) in zip(together, alone, strict=True):
        assert text == want_text
        assert logprobs == pytest.approx(want_logprobs, abs=LOGPROB_ABS)
    assert min(len(logprobs) for _, logprobs in alone) >= 2  # each decodes past its first
    assert max(rows) == CLIENTS, f"the requests never all decoded together: rows {rows}"


def test_a_client_leaving_mid_batch_leaves_the_others_their_answers(
    loaded_tiny, monkeypatch, access_log
):
    rows: list[int] = []
    step = batch_module.DecodeBatch._step
    monkeypatch.setattr(
        batch_module.DecodeBatch, "_step", lambda self: (rows.append(self.num_rows), step(self))
    )
    runner = Runner(loaded_tiny("llama"), max_context=512, cache_entries=16, max_batch=4)
    with serve(runner) as served:
        client = served.openai(timeout=120)
        alone = [_ask(client, i) for i in (1, 2)]
        runner.reset()
        rows.clear()
        read_in_step(monkeypatch, runner, 3)  # all three decode together before any third
        # past the two chunks read in step, until its client has left: it cannot end first
        held_until_left(monkeypatch, runner, lambda options: {200: 3}.get(options["max_tokens"]))
        slots = runner._dispatch._slots
        with ThreadPoolExecutor(2) as pool:
            leaving = client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "Question number 0: tell me more."}],
                max_tokens=200,
                temperature=0,
                stream=True,
            )
            futures = [pool.submit(_ask, client, i) for i in (1, 2)]
            wait_until(lambda: max(rows, default=0) == 3, what="three rows decoding together")
            leaving.close()  # the client goes away mid-batch
            together = [f.result(120) for f in futures]
        left = access_log(r"POST /v1/chat/completions 200 .* generated=(\d+) .*finish=cancelled")
        wait_until(lambda: slots.taken == 0, what="every place given back")
    assert int(left.group(1)) < 200
    for (text, logprobs), (want_text, want_logprobs) in zip(together, alone, strict=True):
        assert text == want_text
        assert logprobs == pytest.approx(want_logprobs, abs=LOGPROB_ABS)
    assert runner._dispatch._batching.batch.num_rows == 0
