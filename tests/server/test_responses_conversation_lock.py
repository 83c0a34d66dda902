"""One response at a time in a conversation, as OpenAI's: a second one while the first is
being made is refused with a 400 `conversation_locked` (before, both ran: the second read the
conversation without the first's turn, and the turns were added in the order the replies
ended). The conversation is free again once the first's turn is added, and whichever way its
request ended otherwise: refused, failed, left by its client, a stream that never started."""

from __future__ import annotations

import asyncio
import http.client
import json
from collections.abc import AsyncIterator

import openai
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect

from mlxkv.server.responses_api.conversations import (
    ConversationClaim,
    Conversations,
    TurnClaim,
    turn_claim,
)

from .conftest import held_worker

MAX_TOKENS = 4
HI = {"role": "user", "content": "Hi there"}


@pytest.fixture(scope="module")
def served(module_server):
    return module_server


def _in(conversation_id: str) -> dict:
    return {"model": "m", "conversation": conversation_id, "max_output_tokens": MAX_TOKENS}


def _assert_locked(client: openai.OpenAI, conversation_id: str) -> None:
    once = client.with_options(timeout=30, max_retries=0)  # not locked: it would wait its turn
    with pytest.raises(openai.BadRequestError) as refused:
        once.responses.create(input="Meanwhile", **_in(conversation_id))
    error = refused.value
    assert (error.code, error.param, error.type) == (
        "conversation_locked", "conversation", "invalid_request_error"
    )  # fmt: skip
    assert "retry" in error.message


async def _kept_past_the_request() -> AsyncIterator[TurnClaim]:
    """A claim the request's end does not release: only the turn's own release does."""
    yield TurnClaim()


def test_a_second_response_meanwhile_is_refused_and_the_next_one_goes_at_once(served, monkeypatch):
    """The claim goes as the turn is added, before the response's last bytes: released at the
    request's end alone, the client's next turn, sent at once, could find it still held."""
    monkeypatch.setitem(served.app.dependency_overrides, turn_claim, _kept_past_the_request)
    client = served.openai()
    conversation = client.conversations.create(items=[HI]).id
    other = client.conversations.create(items=[HI]).id
    with held_worker(served) as release:  # the first waits for its turn, its claim taken
        first = client.responses.create(input="First", stream=True, **_in(conversation))
        events = iter(first)
        assert next(events).type == "response.created"
        _assert_locked(client, conversation)
        _assert_locked(client, conversation)  # a refusal does not free the first's claim
        beside = client.responses.create(input="Other", stream=True, **_in(other))
        assert next(iter(beside)).type == "response.created"  # the claim is one conversation's
        release.set()
        assert list(events)[-1].type in ("response.completed", "response.incomplete")
        beside.close()
    client.responses.create(input="Third", **_in(conversation))  # no wait: free once added
    items = client.conversations.items.list(conversation, order="asc").data
    said = [(item.role, item.content[0].text) for item in items if item.role == "user"]
    assert said == [("user", "Hi there"), ("user", "First"), ("user", "Third")]
    assert [item.role for item in items] == ["user", "user", "assistant", "user", "assistant"]


def test_a_failed_response_frees_its_conversation(served):
    client = served.openai()
    conversation = client.conversations.create(items=[HI]).id
    too_long = {**_in(conversation), "max_output_tokens": 10_000}  # past the 1,024 window
    with pytest.raises(openai.BadRequestError, match="context"):
        client.responses.create(input="Long", **too_long)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.responses.create(input="Long", stream=True, **too_long)
    assert client.responses.create(input="Now", **_in(conversation)).output_text


def test_a_client_that_leaves_frees_its_conversation(served, access_log):
    client = served.openai()
    conversation = client.conversations.create(items=[HI]).id
    with held_worker(served):
        connection = http.client.HTTPConnection(served.host, served.port, timeout=60)
        body = {"input": "Leaving", "stream": True, **_in(conversation)}
        headers = {"Content-Type": "application/json"}
        connection.request("POST", "/v1/responses", json.dumps(body), headers)
        response = connection.getresponse()
        while b"response.created" not in response.readline():  # its claim is taken
            pass
        _assert_locked(client, conversation)
        connection.close()
    access_log(r"POST /v1/responses 200")  # logged once its request has ended
    assert client.responses.create(input="Back", **_in(conversation)).output_text


def test_a_client_that_times_out_adds_nothing_and_frees_its_conversation(served, access_log):
    """Not streamed, its client gone while the generation waited for its turn: the request
    waited forever (its conversation locked for good) and, when it did end, the input was
    added with no reply. Now it ends at once, a 499, and adds nothing."""
    client = served.openai()
    conversation = client.conversations.create(items=[HI]).id
    impatient = client.with_options(timeout=1, max_retries=0)
    with held_worker(served):
        with pytest.raises(openai.APITimeoutError):
            impatient.responses.create(input="Gone", **_in(conversation))
        access_log(r"POST /v1/responses 499")  # ended while the worker is still held
    items = client.conversations.items.list(conversation).data
    assert [item.content[0].text for item in items] == ["Hi there"]
    assert client.responses.create(input="Back", **_in(conversation)).output_text


def test_a_stream_that_never_starts_frees_its_conversation():
    """The client left before the status line went out: the response's body (where the turn
    is added) never runs, and the claim goes when the request ends."""
    conversations = Conversations()
    conversation = conversations.create([HI], {}, None).id
    app = FastAPI()

    @app.post("/")
    async def respond(claim: ConversationClaim):
        claim.take(conversations, conversation)

        async def body():
            yield "never read"

        return StreamingResponse(body())

    async def gone(message):
        if message["type"] == "http.response.start":
            raise OSError("the client left")

    async def request():
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [], "query_string": b""}
    scope |= {"asgi": {"version": "3.0", "spec_version": "2.4"}, "root_path": "", "raw_path": b"/"}
    with pytest.raises(ClientDisconnect):
        asyncio.run(app(scope, request, gone))
    conversations.claim(conversation)()  # free: claimed and released again
