"""What the Responses API keeps on the server, through the real `openai` client: a stored
response read back, its input items listed, deleted; its input tokens counted before it is
sent; and Conversations (`/v1/conversations`, a response's `conversation`), as the OpenAI
Agents SDK's `OpenAIConversationsSession` and `conversation_id` runs use them. Before, each of
these routes was a 404 and `conversation` was dropped (the reply came without its history).
Replies are checked against a fresh Runner given the whole conversation."""

from __future__ import annotations

import asyncio

import openai
import pytest

from mlxkv import Runner
from mlxkv.server.errors import ApiError
from mlxkv.server.responses_api.conversations import Conversations, checked_items
from mlxkv.testing.factory import build_scripted_model

from .conftest import serve

MAX_TOKENS = 8
HI = {"role": "user", "content": "Hi there"}


@pytest.fixture(scope="module")
def served(module_server):
    return module_server


def test_a_stored_response_is_read_listed_and_deleted(served):
    client = served.openai()
    created = client.responses.create(model="m", input="Hello", max_output_tokens=MAX_TOKENS)
    read = client.responses.retrieve(created.id)
    assert (read.id, read.output_text, read.usage) == (
        created.id,
        created.output_text,
        created.usage,
    )
    items = client.responses.input_items.list(created.id).data
    assert [(item.type, item.role, item.content[0].text) for item in items] == [
        ("message", "user", "Hello")
    ]
    assert items[0].id
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError, match=created.id):
        client.responses.retrieve(created.id)
    with pytest.raises(openai.BadRequestError, match="not found"):
        client.responses.create(model="m", input="Again", previous_response_id=created.id)
    unstored = client.responses.create(model="m", input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_input_tokens_are_counted_as_the_response_takes_them(served):
    client = served.openai()
    ask = {"model": "m", "input": "Count me", "instructions": "Be brief."}
    counted = client.responses.input_tokens.count(**ask)
    created = client.responses.create(**ask, max_output_tokens=2)
    assert counted.input_tokens == created.usage.input_tokens


def test_a_response_in_a_conversation_answers_all_of_it_and_adds_to_it(served, fresh_runner):
    client = served.openai()
    conversation = client.conversations.create(items=[HI], metadata={"topic": "greetings"})
    assert client.conversations.retrieve(conversation.id).metadata == {"topic": "greetings"}
    first = client.responses.create(
        model="m", input="Hello again", conversation=conversation.id, max_output_tokens=MAX_TOKENS
    )
    items = client.conversations.items.list(conversation.id, order="asc").data
    assert [(item.type, item.role) for item in items] == [
        ("message", "user"), ("message", "user"), ("message", "assistant")
    ]  # fmt: skip
    assert items[-1].id == first.output[0].id

    second = client.responses.create(
        model="m",
        input="And now?",
        conversation={"id": conversation.id},
        max_output_tokens=MAX_TOKENS,
    )
    whole = [HI, {"role": "user", "content": "Hello again"}]
    whole += [{"role": "assistant", "content": first.output_text}]
    reference = fresh_runner()
    reference.generate(whole[:2], max_tokens=MAX_TOKENS)
    expected = reference.generate(
        [*whole, {"role": "user", "content": "And now?"}], max_tokens=MAX_TOKENS
    )
    assert second.output_text == expected.text
    assert second.usage.input_tokens == expected.prompt_tokens
    assert second.usage.input_tokens_details.cached_tokens == expected.cached_tokens


def test_conversation_items_are_paged_added_and_deleted(served):
    client = served.openai()
    texts = [f"message {n}" for n in range(5)]
    conversation = client.conversations.create(
        items=[{"role": "user", "content": text} for text in texts]
    )
    newest = client.conversations.items.list(conversation.id, limit=2)  # desc by default
    assert [item.content[0].text for item in newest.data] == texts[:2:-1][:2]
    assert newest.has_more
    after = client.conversations.items.list(conversation.id, limit=2, after=newest.last_id)
    assert [item.content[0].text for item in after.data] == [texts[2], texts[1]]
    every = [item.content[0].text for item in client.conversations.items.list(conversation.id)]
    assert every == texts[::-1]  # the SDK's iterator follows the pages

    added = client.conversations.items.create(
        conversation.id, items=[{"type": "message", "role": "assistant", "content": "ok"}]
    )
    (item,) = added.data
    assert (
        client.conversations.items.retrieve(item.id, conversation_id=conversation.id).id == item.id
    )
    client.conversations.items.delete(item.id, conversation_id=conversation.id)
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(item.id, conversation_id=conversation.id)
    too_many = [{"role": "user", "content": "x"}] * 21
    with pytest.raises(openai.BadRequestError, match="at most 20"):
        client.conversations.items.create(conversation.id, items=too_many)

    client.conversations.delete(conversation.id)
    with pytest.raises(openai.NotFoundError, match=conversation.id):
        client.conversations.retrieve(conversation.id)
    with pytest.raises(openai.NotFoundError, match=conversation.id):
        client.responses.create(model="m", input="Hi", conversation=conversation.id)


def test_one_history_or_the_other(served):
    client = served.openai()
    created = client.responses.create(model="m", input="Hello", max_output_tokens=2)
    conversation = client.conversations.create()
    with pytest.raises(openai.BadRequestError, match="not both"):
        client.responses.create(
            model="m", input="Hi", conversation=conversation.id, previous_response_id=created.id
        )


def test_conversations_are_bounded_the_least_recently_used_dropped_first():
    held = Conversations(max_conversations=2)
    a, b = (held.create([HI], {}, None).id for _ in range(2))
    held.get(a, None)  # used: b is the oldest now
    c = held.create([], {}, None).id
    with pytest.raises(ApiError, match=b):
        held.get(b, None)
    assert held.get(a, None).items and held.get(c, None).items == []


def test_one_conversation_cannot_grow_past_the_bound():
    """The newest conversation was never dropped, so adds to it grew it without end; and its
    metadata counted for nothing."""
    held = Conversations(max_chars=2_000)
    kept = held.create([HI], {}, None)
    for _ in range(20):
        try:
            held.add(kept.id, checked_items([{"role": "user", "content": "x" * 100}]), None)
        except ApiError as error:
            assert error.status == 400
            break
    else:
        pytest.fail("the conversation grew past the bound")
    assert held._held.chars <= 2_000 and held.get(kept.id, None).items  # kept as it was
    with pytest.raises(ApiError, match="metadata"):
        held.create([], {"note": "y" * 5_000}, None)


def test_what_a_tenant_keeps_is_its_own(served):
    """Stored responses and conversations made with a `cache_salt` are reached with it only."""
    client = served.openai()
    mine = {"cache_salt": "tenant-a"}
    created = client.responses.create(
        model="m", input="Hello", max_output_tokens=2, extra_body=mine
    )
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    assert client.responses.retrieve(created.id, extra_query=mine).id == created.id
    with pytest.raises(openai.BadRequestError, match="not found"):
        client.responses.create(
            model="m", input="Hi", previous_response_id=created.id,
            extra_body={"cache_salt": "tenant-b"},
        )  # fmt: skip
    conversation = client.conversations.create(extra_body=mine)
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.list(conversation.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="m", input="Hi", conversation=conversation.id)
    reply = client.responses.create(
        model="m", input="Hi", conversation=conversation.id, max_output_tokens=2, extra_body=mine
    )
    assert reply.conversation.id == conversation.id


def test_a_reply_stands_when_its_conversation_went_meanwhile(served, monkeypatch):
    """Deleted (or dropped for room) while the reply was generated: the finished reply was a
    404 (streamed: response.failed)."""
    client = served.openai()
    conversation = client.conversations.create(items=[HI])
    held = served.app.state.conversations
    add = held.add

    def deleted_first(conversation_id, items, salt, **options):
        held.delete(conversation_id, salt)
        return add(conversation_id, items, salt, **options)

    monkeypatch.setattr(held, "add", deleted_first)
    reply = client.responses.create(
        model="m", input="Hi", conversation=conversation.id, max_output_tokens=2
    )
    assert reply.status in ("completed", "incomplete") and reply.output_text


def test_a_conversation_takes_only_items_a_response_can_read(served):
    """A message without a role (or a call without its name) was taken, and every response
    in the conversation afterwards was a 400 naming `input[0]`; an id given again made two
    items of one id."""
    client = served.openai()
    conversation = client.conversations.create(items=[HI])
    bad = {
        "no-role": {"type": "message", "content": "no role"},
        "call-without-name": {"type": "function_call", "arguments": "{}"},
        "reference": {"type": "item_reference", "id": "msg_x"},
    }
    for name, item in bad.items():
        with pytest.raises(openai.BadRequestError, match=r"items\[0\]"):
            client.conversations.items.create(conversation.id, items=[item])
        assert len(client.conversations.items.list(conversation.id).data) == 1, name
    (held,) = client.conversations.items.list(conversation.id).data
    again = {"id": held.id, "role": "user", "content": "again"}
    with pytest.raises(openai.BadRequestError, match="already in the conversation"):
        client.conversations.items.create(conversation.id, items=[again])
    reply = client.responses.create(
        model="m", input="Hi", conversation=conversation.id, max_output_tokens=2
    )
    assert reply.output_text


def test_pages_of_input_items_and_a_bad_after(served):
    client = served.openai()
    items = [{"role": "user", "content": f"part {n}"} for n in range(3)]
    created = client.responses.create(model="m", input=items, max_output_tokens=2)
    page = client.responses.input_items.list(created.id, limit=2, order="asc")
    assert [item.content[0].text for item in page.data] == ["part 0", "part 1"]
    assert page.has_more
    with pytest.raises(openai.BadRequestError, match="after"):
        client.responses.input_items.list(created.id, after="msg_nonesuch")
    with pytest.raises(openai.BadRequestError, match="conversation.id"):
        client.responses.create(model="m", input="Hi", conversation={})


def test_the_agents_sdk_keeps_a_session_in_a_conversation(tmp_path):
    """Two runs of an agent on one `OpenAIConversationsSession`: the second sees the first
    (its items come back from the server) and reuses its cache."""
    agents = pytest.importorskip("agents")
    path = build_scripted_model(tmp_path / "greeter", ("Hi", " Bob"))  # a reply that ends
    with serve(Runner.load(path)) as scripted:
        client = openai.AsyncOpenAI(base_url=scripted.url + "/v1", api_key="unused")
        agents.set_tracing_disabled(True)
        model = agents.OpenAIResponsesModel("m", client)
        agent = agents.Agent(name="a", instructions="Be brief.", model=model)

        async def two_runs():
            session = agents.OpenAIConversationsSession(openai_client=client)
            await agents.Runner.run(agent, "My name is Bob.", session=session)
            second = await agents.Runner.run(agent, "What is my name?", session=session)
            return second.raw_responses[-1].usage, await session.get_items()

        usage, items = asyncio.run(two_runs())
    assert [(item["role"], item["content"][0]["text"]) for item in items] == [
        ("user", "My name is Bob."), ("assistant", "Hi Bob"),
        ("user", "What is my name?"), ("assistant", "Hi Bob"),
    ]  # fmt: skip
    assert usage.input_tokens_details.cached_tokens > 0
