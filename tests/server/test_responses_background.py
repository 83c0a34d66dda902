"""Background responses (`background: true`), as OpenAI's background mode, through the real
`openai` client. Before, `background` was ignored: the request waited for the whole reply and
the response said `background: false`, `/cancel` was a 404 and a dropped stream was lost.
Now the create call answers at once (`queued`), the response is polled, streamed again from
any event (`starting_after`), cancelled (twice: the same), and ends as any other: stored, its
turn added to its conversation, which stays claimed until then; a cancelled one adds nothing.
Replies are checked against a fresh Runner's log-probabilities."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
from collections.abc import AsyncIterator
from types import SimpleNamespace

import openai
import pytest

from mlxkv import Runner
from mlxkv.server.responses_api import background
from mlxkv.server.responses_api.background import BackgroundRun, background_responses
from mlxkv.server.responses_api.history import ResponseHistory
from mlxkv.server.responses_api.protocol import ResponsesRequest
from mlxkv.server.responses_api.routes import _Response

from .conftest import held_until_left, held_worker, serve

MAX_TOKENS = 6
QUESTION = "Once upon a time there was"
LOGPROBS = {"include": ["message.output_text.logprobs"], "temperature": 0}
ASK = {"model": "m", "input": QUESTION, "max_output_tokens": MAX_TOKENS, **LOGPROBS}
ENDED = ("completed", "incomplete")  # cut at MAX_TOKENS or not, as the tiny model goes


@pytest.fixture(scope="module")
def served(module_server):
    return module_server


def _fresh_logprobs(fresh_runner, text: str = QUESTION) -> list[float]:
    messages = [{"role": "user", "content": text}]
    chunks = fresh_runner().stream(messages, max_tokens=MAX_TOKENS, temperature=0, logprobs=0)
    return [chunk.logprob.logprob for chunk in chunks if chunk.logprob is not None]


def _logprobs(response) -> list[float]:
    return [token.logprob for token in response.output[0].content[0].logprobs]


def _ended(client: openai.OpenAI, response_id: str):
    """The response once it has ended: its events read to their end (no polling clock)."""
    for _ in client.responses.retrieve(response_id, stream=True):
        pass
    return client.responses.retrieve(response_id)


def test_a_background_response_answers_at_once_and_is_read_when_made(served, fresh_runner):
    client = served.openai()
    with held_worker(served) as release:  # it cannot start: the create call must not wait
        made = client.responses.create(**ASK, background=True)
        assert (made.status, made.background, made.output) == ("queued", True, [])
        assert client.responses.retrieve(made.id).status == "queued"
        release.set()
        done = _ended(client, made.id)
    assert done.status in ENDED and done.background is True
    assert _logprobs(done) == pytest.approx(_fresh_logprobs(fresh_runner), abs=1e-4)
    assert done.usage.output_tokens == len(_logprobs(done))
    follow = client.responses.create(**{**ASK, "input": "And then"}, previous_response_id=made.id)
    assert follow.usage.input_tokens_details.cached_tokens > done.usage.input_tokens  # its turn
    with pytest.raises(openai.NotFoundError):  # another tenant's id
        client.responses.retrieve(made.id, extra_query={"cache_salt": "other"})


def _gated(monkeypatch, runner) -> threading.Event:
    """The runner's generations wait after their first text until the returned event is set
    (or they are cancelled)."""
    stream, gate = runner.stream, threading.Event()

    def held(*args, **kwargs):
        for chunk in stream(*args, **kwargs):
            yield chunk
            if chunk.text:
                gate.wait(30)

    monkeypatch.setattr(runner, "stream", held)
    return gate


def test_a_stream_left_goes_on_and_is_read_again_from_any_event(served, fresh_runner, monkeypatch):
    client = served.openai()
    gate = _gated(monkeypatch, served.runner)  # it cannot end before its client has left
    with client.responses.create(**ASK, background=True, stream=True) as stream:
        first = [next(iter(stream)) for _ in range(3)]  # then the client leaves
    gate.set()
    assert [e.type for e in first] == [
        "response.created",
        "response.queued",
        "response.in_progress",
    ]
    response_id = first[0].response.id
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=2))
    assert [e.sequence_number for e in first + rest] == list(range(len(first) + len(rest)))
    assert rest[-1].type in ("response.completed", "response.incomplete")
    again = list(client.responses.retrieve(response_id, stream=True))  # every event, again
    assert [e.model_dump() for e in again] == [e.model_dump() for e in first + rest]
    final = client.responses.retrieve(response_id)
    assert final.model_dump() == rest[-1].response.model_dump()
    assert _logprobs(final) == pytest.approx(_fresh_logprobs(fresh_runner), abs=1e-4)


def test_a_queued_response_is_cancelled_and_cancelling_again_returns_it(served):
    client = served.openai()
    asked = {**ASK, "background": True, "stream": True}
    with held_worker(served), client.responses.create(**asked) as stream:
        events = iter(stream)
        made = next(events).response
        assert next(events).type == "response.queued"
        cancelled = client.responses.cancel(made.id)
        assert list(events) == []  # never in progress; OpenAI has no event for a cancel
    assert (cancelled.status, cancelled.output) == ("cancelled", [])
    assert client.responses.cancel(made.id).model_dump() == cancelled.model_dump()
    assert client.responses.retrieve(made.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError) as refused:  # not a turn to continue
        client.responses.create(**ASK, previous_response_id=made.id)
    assert refused.value.code == "previous_response_not_found"  # what clients recover from
    assert "it was cancelled" in refused.value.message


def test_a_response_cancelled_mid_reply_keeps_what_it_wrote_and_adds_no_turn(served, monkeypatch):
    client = served.openai()
    conversation = client.conversations.create(items=[{"role": "user", "content": "Hi"}]).id
    held_until_left(monkeypatch, served.runner, lambda options: 2)  # waits after two texts
    in_it = {**ASK, "conversation": conversation, "background": True}
    with client.responses.create(**in_it, stream=True) as stream:
        made_id = next(iter(stream)).response.id
        assert any(event.type == "response.output_text.delta" for event in stream)
    (model,) = served.app.state.mlxkv.models.resident.values()
    assert model.in_flight == 1  # its model held while it is made, once
    polled = client.responses.retrieve(made_id)
    assert polled.status == "in_progress" and polled.output[0].content[0].text  # so far
    assert polled.output[0].status == "in_progress"  # being written
    with pytest.raises(openai.BadRequestError) as locked:  # still being made in it
        client.responses.create(**{**in_it, "background": False})
    assert locked.value.code == "conversation_locked"
    cancelled = client.responses.cancel(made_id)
    assert model.in_flight == 0  # and released as it ended
    assert cancelled.status == "cancelled" and cancelled.output[0].content[0].text
    assert cancelled.output[0].status == "incomplete"  # cut by the cancel
    monkeypatch.undo()
    items = client.conversations.items.list(conversation).data
    assert [item.role for item in items] == ["user"]  # nothing of the cancelled turn
    after = client.responses.create(**{**in_it, "background": False})  # free again
    assert after.status in ENDED


def test_a_background_turn_is_added_to_its_conversation_which_it_claims_meanwhile(served):
    client = served.openai()
    conversation = client.conversations.create().id
    in_it = {**ASK, "conversation": conversation}
    with held_worker(served) as release:
        made = client.responses.create(**in_it, background=True)
        with pytest.raises(openai.BadRequestError) as locked:
            client.responses.create(**in_it)
        assert locked.value.code == "conversation_locked"
        release.set()
        done = _ended(client, made.id)
    items = client.conversations.items.list(conversation, order="asc").data
    assert [item.role for item in items] == ["user", "assistant"]
    assert items[1].content[0].text == done.output[0].content[0].text
    client.responses.create(**in_it)  # free once it ended


def test_a_background_response_waits_for_its_turn_past_the_queue_timeout(loaded_tiny):
    """Nobody waits for it: OpenAI keeps it queued; a request that waits gets the 503."""
    with serve(Runner(loaded_tiny("llama"), max_context=1024), queue_timeout_s=0.05) as served:
        client = served.openai()
        with held_worker(served) as release:
            made = client.responses.create(**ASK, background=True)
            with pytest.raises(openai.InternalServerError) as busy:  # sent after, waited less
                client.responses.create(**ASK)
            assert busy.value.status_code == 503
            release.set()
            assert _ended(client, made.id).status in ENDED


def test_a_running_response_deleted_is_cancelled_first(served):
    client = served.openai()
    with held_worker(served):
        made = client.responses.create(**ASK, background=True)
        with pytest.raises(openai.NotFoundError):  # another tenant's
            client.responses.cancel(made.id, extra_query={"cache_salt": "other"})
        client.responses.delete(made.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(made.id)


def test_events_past_what_a_response_keeps_are_refused_not_skipped(served, monkeypatch):
    monkeypatch.setattr(background_responses(served.app), "_max_run_chars", 4000)
    client = served.openai()
    made = client.responses.create(**ASK, background=True)
    past = client.responses.retrieve(made.id, stream=True, starting_after=10**6)
    assert list(past) == []  # after its last event: nothing more, once it has ended
    with pytest.raises(openai.BadRequestError) as refused:  # its first events went
        list(client.responses.retrieve(made.id, stream=True, starting_after=0))
    assert refused.value.param == "starting_after"
    with pytest.raises(openai.BadRequestError) as from_the_start:
        list(client.responses.retrieve(made.id, stream=True))
    assert from_the_start.value.param == "stream"  # what the client sent
    run = background_responses(served.app).find(made.id, None)
    tail = list(client.responses.retrieve(made.id, stream=True, starting_after=run.first - 1))
    assert tail[-1].type in ("response.completed", "response.incomplete")
    assert [event.sequence_number for event in tail][0] == run.first


def test_what_cannot_be_cancelled_or_streamed_again_is_refused(served):
    client = served.openai()
    with pytest.raises(openai.BadRequestError) as unstored:
        client.responses.create(**ASK, background=True, store=False)
    assert unstored.value.param == "background"
    plain = client.responses.create(**ASK)
    with pytest.raises(openai.BadRequestError) as not_background:
        client.responses.cancel(plain.id)
    assert "background" in not_background.value.message
    with pytest.raises(openai.BadRequestError):
        list(client.responses.retrieve(plain.id, stream=True))
    made = client.responses.create(**ASK, background=True)
    assert _ended(client, made.id).status in ENDED
    with pytest.raises(openai.BadRequestError) as ended:
        client.responses.cancel(made.id)
    assert "ended" in ended.value.message
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)


@pytest.mark.parametrize("how", ["signal", "app_exit"])
def test_a_stopping_server_ends_what_it_makes_in_the_background(
    loaded_tiny, monkeypatch, tmp_path, how
):
    """`failed`, in the server's words, with what it wrote, and before its models close (a
    generation left running then would end by the event loop's teardown, after the Runner it
    runs on was closed): a stop signal's path, and an app whose server just exits. So it is
    in its file too, for the next server to read."""
    runner = Runner(loaded_tiny("llama"), max_context=1024)
    held_until_left(monkeypatch, runner, lambda options: 1)  # waits after its first text
    with serve(runner, state_dir=tmp_path) as served:
        residency = served.app.state.mlxkv.models.residency
        shutdown, ended_before = residency.shutdown, []
        monkeypatch.setattr(
            residency, "shutdown", lambda *a: (ended_before.append(run.ended), shutdown(*a))
        )
        client = served.openai()
        with client.responses.create(**ASK, background=True, stream=True) as stream:
            made_id = next(iter(stream)).response.id
            assert any(event.type == "response.output_text.delta" for event in stream)
            run = background_responses(served.app).find(made_id, None)
            if how == "signal":  # its reader is told (with no signal: it leaves first)
                served.server.handle_exit(signal.SIGINT, None)  # what the signal handler calls
                assert list(stream)[-1].type == "response.failed"
    assert ended_before == [True] and run.status == "failed"
    assert "shutting down" in run.latest["error"]["message"]
    assert run.latest["output"][0]["content"][0]["text"]  # what it wrote, kept
    used = run.latest["usage"]  # and what it used (was null)
    assert used["output_tokens"] >= 1 and used["input_tokens"] > used["output_tokens"]
    saved = json.loads((tmp_path / f"{made_id}.json").read_text())["response"]
    assert (saved["status"], saved["usage"], saved["error"]) == (
        "failed",
        used,
        run.latest["error"],
    )


def test_a_reader_whose_next_events_went_meanwhile_is_told_so():
    """A burst of large events (with 20 `top_logprobs`, each closing event holds every
    token's) can push out those a live reader has not read yet: its stream ended silently,
    with no final event (recheck22b); it now ends with an `error` event saying so."""

    async def scenario():
        made = SimpleNamespace(latest={"status": "in_progress"})
        run = BackgroundRun(made, turn=None, salt=None, max_chars=10)
        reader = run.read()
        for line in ("aaaa", "bbbb", "cccc", "dddd"):  # 16 characters: the first two go
            run._add(line)
        told = await anext(reader)
        assert '"code": "events_dropped"' in told and '"sequence_number": 0' in told
        assert [line async for line in reader] == []

    asyncio.run(scenario())


def test_a_reader_paused_mid_stream_whose_next_events_went_is_told_so():
    """Paused at its last event (its client slow to take it) while later ones pushed out
    those after it: it read from the wrong end of the events, or failed (review22b)."""

    async def scenario():
        made = SimpleNamespace(latest={"status": "in_progress"})
        run = BackgroundRun(made, turn=None, salt=None, max_chars=10)
        run._add("e0")
        reader = run.read()
        assert await anext(reader) == "e0"
        for line in ("e1x", "e2x", "e3x", "e4x"):  # 14 characters: e0 and e1x go
            run._add(line)
        told = await anext(reader)
        assert '"code": "events_dropped"' in told and '"sequence_number": 1' in told

    asyncio.run(scenario())


def test_a_run_still_stuck_when_the_stop_gives_up_waiting_ends_failed_too(monkeypatch):
    """Cut by the stop's task cancel after `CLOSE_WAIT_S`: it ended `cancelled`, no event
    said why (review22b)."""
    monkeypatch.setattr(background, "CLOSE_WAIT_S", 0.01)

    async def never() -> AsyncIterator[str]:
        await asyncio.Event().wait()
        yield ""

    async def scenario():
        stuck = SimpleNamespace(cancel=lambda: None, prompt=None)  # a generation that does not stop
        response = _Response(ResponsesRequest(input="Hi", background=True), "m", None, stuck)
        run = BackgroundRun(response, stuck, salt=None, max_chars=2**20)
        held = background.BackgroundResponses(ResponseHistory())
        held._running[response.id] = run
        run.start(never(), (), lambda _: None)
        await held.close()
        assert run.ended and run.status == "failed"
        assert "shutting down" in run.latest["error"]["message"]
        assert '"type": "response.failed"' in run.lines[-1]
        assert run.latest["usage"] is None  # it never started

    asyncio.run(scenario())
