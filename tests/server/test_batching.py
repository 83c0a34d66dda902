"""Eight clients at once through the real `openai` client: every answer equals the one the
same request gets alone, and the requests decoded together."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from mlxkv import Runner
from mlxkv.decoding import batch as batch_module
from tests.factories import wait_until
from tests.server.conftest import held_worker, serve

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
        with held_worker(served) as release, ThreadPoolExecutor(CLIENTS) as pool:
            futures = [pool.submit(_ask, client, i) for i in range(CLIENTS)]
            worker = served.app.state.mlxkv.worker
            wait_until(lambda: worker._pending == CLIENTS, what="all eight requests queued")
            release.set()
            together = [f.result(120) for f in futures]
    for (text, logprobs), (want_text, want_logprobs) in zip(together, alone, strict=True):
        assert text == want_text
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)
    assert max(rows) >= 4, f"the requests hardly decoded together: rows {sorted(set(rows))}"
