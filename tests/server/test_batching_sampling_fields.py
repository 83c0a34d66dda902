"""Eight `openai` clients at once, each with sampling fields of its own (penalties, a logit
bias, a stop string, a seeded sampled reply, a short max_tokens), decoded together: every
answer, its log-probabilities and finish reason equal the same request alone on a fresh
Runner; and two models served at once answer as each does alone (issue 27 recheck)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from mlxkv import Runner
from mlxkv.decoding import batch as batch_module
from tests.factories import read_in_step, wait_until
from tests.server.conftest import held_worker, serve
from tests.tolerances import LOGPROB_ABS

# (the OpenAI request's fields, the same settings as Runner options)
FIELDS = [
    ({"presence_penalty": 1.5}, {"presence_penalty": 1.5}),
    ({"frequency_penalty": 1.2}, {"frequency_penalty": 1.2}),
    ({"logit_bias": {"65": 4}}, {"logit_bias": {65: 4.0}}),
    ({"stop": ["e"]}, {"stop": ["e"]}),
    ({"temperature": 0.9, "seed": 5}, {"temperature": 0.9, "seed": 5}),
    ({"max_tokens": 5}, {"max_tokens": 5}),
    ({}, {}),
    (
        {"presence_penalty": -1.0, "logit_bias": {"70": -100}},
        {"presence_penalty": -1.0, "logit_bias": {70: -100.0}},
    ),
]


def _messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Question number {i}: " + "why? " * i}]


def _ask(client, i: int, model: str = "m") -> tuple[str, list[float], str]:
    fields = {"max_tokens": 20, "temperature": 0, **FIELDS[i][0]}
    reply = client.chat.completions.create(
        model=model, messages=_messages(i), logprobs=True, **fields
    )
    choice = reply.choices[0]
    return (
        choice.message.content,
        [t.logprob for t in choice.logprobs.content],
        choice.finish_reason,
    )


def _alone(loaded, i: int) -> tuple[str, list[float], str]:
    options = {"max_tokens": 20, "temperature": 0.0, **FIELDS[i][1]}
    chunks = list(Runner(loaded, max_context=512).stream(_messages(i), logprobs=0, **options))
    completion = chunks[-1].completion
    return (
        completion.text,
        [c.logprob.logprob for c in chunks if c.logprob],
        completion.finish_reason,
    )


def _assert_same(got, want) -> None:
    for (text, logprobs, reason), (want_text, want_logprobs, want_reason) in zip(
        got, want, strict=True
    ):
        assert text == want_text and reason == want_reason
        assert logprobs == pytest.approx(want_logprobs, abs=LOGPROB_ABS, rel=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "lfm2"])
def test_clients_with_their_own_sampling_fields_get_their_alone_answers(
    loaded_tiny, monkeypatch, arch
):
    rows: list[int] = []
    step = batch_module.DecodeBatch._step
    monkeypatch.setattr(
        batch_module.DecodeBatch, "_step", lambda self: (rows.append(self.num_rows), step(self))[1]
    )
    loaded = loaded_tiny(arch)
    want = [_alone(loaded, i) for i in range(len(FIELDS))]
    runner = Runner(loaded, max_context=512, cache_entries=16, max_batch=len(FIELDS))
    read_in_step(monkeypatch, runner, len(FIELDS))  # the server's worker reads each stream
    with serve(runner) as served:
        client = served.openai(timeout=120)
        with held_worker(served) as release, ThreadPoolExecutor(len(FIELDS)) as pool:
            futures = [pool.submit(_ask, client, i) for i in range(len(FIELDS))]
            worker = served.app.state.mlxkv.worker
            wait_until(lambda: worker._pending == len(FIELDS), what="every request queued")
            release.set()
            got = [f.result(120) for f in futures]
    _assert_same(got, want)
    # Every row that batches and decodes past its first token meets all such others in one
    # step (read in step); the short one (max_tokens 5) too, unless it has its tokens first.
    meeting = [
        i
        for i, (fields, _) in enumerate(FIELDS)
        if "seed" not in fields and "max_tokens" not in fields and len(want[i][1]) >= 2
    ]
    assert len(meeting) <= max(rows) <= len(meeting) + 1, (meeting, rows)


def test_two_models_served_at_once_answer_as_each_alone(loaded_tiny):
    archs = {"a": "llama", "b": "lfm2"}
    want = {name: [_alone(loaded_tiny(arch), i) for i in range(4)] for name, arch in archs.items()}
    runners = {
        name: Runner(loaded_tiny(arch), max_context=512, cache_entries=8, max_batch=4)
        for name, arch in archs.items()
    }
    with serve(runners) as served, ThreadPoolExecutor(8) as pool:
        client = served.openai(timeout=120)
        futures = {name: [pool.submit(_ask, client, i, name) for i in range(4)] for name in archs}
        got = {name: [f.result(120) for f in futures[name]] for name in archs}
    for name in archs:
        _assert_same(got[name], want[name])
