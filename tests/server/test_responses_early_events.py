"""Responses streams whose first token is late (the worker held, as a long prefill holds it)
send response.in_progress again (`early_events`), read through the real `openai` SDK's stream
helper, which Codex-like clients use: it takes the repeated event, the sequence numbers still
count up one by one, and the final response is what an unheld request gets; a wait that runs
out still ends the stream with response.failed (review rs11c)."""

from __future__ import annotations

import threading

import pytest

from mlxkv import Runner
from mlxkv.server import early_events, state
from tests.server.conftest import held_worker, serve

REQUEST = {"model": "m", "input": "hi", "max_output_tokens": 3, "temperature": 0}
_READ_TIMEOUT_S = 60
_THIRD_EVENT_TIMEOUT_S = 10  # 200 keep-alive intervals


@pytest.fixture
def early(monkeypatch):
    """Keep-alives every 50 ms, the early events after 100 ms."""
    monkeypatch.setattr(state, "KEEPALIVE_INTERVAL_S", 0.05)
    monkeypatch.setattr(early_events, "EARLY_EVENT_AFTER_S", 0.1)


def _read_held(served, read, until_the_end: bool = False) -> tuple[list, bool]:
    """The events `read(events, third_seen)` collects with the worker held until the third
    event reached the SDK (two in_progress past response.created), or `until_the_end` of the
    stream, then released."""
    events: list = []
    third_seen = threading.Event()
    reader = threading.Thread(target=read, args=(events, third_seen))
    with held_worker(served) as release:
        reader.start()
        seen = third_seen.wait(timeout=_THIRD_EVENT_TIMEOUT_S)
        if until_the_end:
            reader.join(timeout=_READ_TIMEOUT_S)
        release.set()
    reader.join(timeout=_READ_TIMEOUT_S)
    assert not reader.is_alive()
    return events, seen


def test_the_stream_helper_takes_repeated_in_progress(loaded_tiny, early):
    with serve(Runner(loaded_tiny("llama"), max_context=1024), model_name="m") as served:
        client = served.openai(max_retries=0)
        expected = client.responses.create(**REQUEST).output_text

        def read(events, third_seen) -> None:
            with client.responses.stream(**REQUEST) as stream:
                for event in stream:
                    events.append(event)
                    if len(events) == 3:
                        third_seen.set()

        events, seen = _read_held(served, read)
    assert seen, [e.type for e in events]
    assert [e.type for e in events[:3]] == ["response.created", *["response.in_progress"] * 2]
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
    # cut by max_output_tokens: the SDK's get_final_response() wants response.completed
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == expected


def test_a_wait_that_runs_out_ends_with_response_failed(loaded_tiny, early):
    runner = Runner(loaded_tiny("llama"), max_context=1024)
    with serve(runner, model_name="m", queue_timeout_s=0.5) as served:
        client = served.openai(max_retries=0)

        def read(events, third_seen) -> None:
            for event in client.responses.create(**REQUEST, stream=True):
                events.append(event)
                if len(events) == 3:
                    third_seen.set()

        events, seen = _read_held(served, read, until_the_end=True)
    assert seen and [e.type for e in events[:3]][1:] == ["response.in_progress"] * 2
    assert events[-1].type == "response.failed", [e.type for e in events]
    assert "waited" in events[-1].response.error.message
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
