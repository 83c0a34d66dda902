"""Anthropic's message threads, as the real SDK's `beta.messages.thread()` and tool runner use
them by default: a `continue` sends only the new turn, and the server answers it as the whole
conversation (checked against a fresh Runner given all of it, and against the same thread
sent without `thread`); the system prompt and tools stay the thread's; a thread the server
does not hold is a 404 `thread_not_found`, on which the SDK sends the whole history again."""

from __future__ import annotations

import json

import anthropic
import pytest
from anthropic import beta_tool

from mlxkv import Runner
from mlxkv.server.anthropic_api.protocol import Message, MessagesRequest
from mlxkv.server.anthropic_api.threads import MessageThreads
from mlxkv.server.errors import ApiError

from .conftest import WEATHER, serve

SYSTEM = "You are a pirate."
FIRST = {"role": "user", "content": "My name is Bob."}
SECOND = {"role": "user", "content": "What is my name?"}
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def served(loaded_tiny):
    with serve(Runner(loaded_tiny("llama"), max_context=1024)) as served:
        yield served


def _sent(client: anthropic.Anthropic) -> list[dict]:
    """Every request body `client` sends, from now on."""
    bodies: list[dict] = []
    client._client.event_hooks["request"].append(
        lambda request: bodies.append(json.loads(request.content))
    )
    return bodies


def test_a_continued_turn_answers_the_whole_conversation(served, fresh_runner):
    client = served.anthropic()
    sent = _sent(client)
    thread = client.beta.messages.thread(model="m", max_tokens=MAX_TOKENS, system=SYSTEM)
    first = thread.send(FIRST)
    second = thread.send(SECOND)
    assert sent[1]["thread"] == {"type": "continue", "previous_message_id": first.id}
    assert sent[1]["messages"] == [SECOND] and "system" not in sent[1]  # the new turn alone

    whole = [
        {"role": "system", "content": SYSTEM},
        FIRST,
        {"role": "assistant", "content": first.content[0].text},
        SECOND,
    ]
    reference = fresh_runner()
    reference.generate(whole[:2], max_tokens=MAX_TOKENS)
    expected = reference.generate(whole, max_tokens=MAX_TOKENS)
    assert second.content[0].text == expected.text
    usage = second.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == expected.prompt_tokens
    assert usage.cache_read_input_tokens == expected.cached_tokens  # prompt and reply


def test_a_streamed_thread_keeps_its_reply(served):
    client = served.anthropic()
    sent = _sent(client)
    thread = client.beta.messages.thread(model="m", max_tokens=MAX_TOKENS, system=SYSTEM)
    with thread.stream(FIRST) as stream:
        first = stream.get_final_message()
    second = thread.send(SECOND)
    assert [body["thread"]["type"] for body in sent] == ["create", "continue"]  # held
    unthreaded = client.messages.create(
        model="m",
        max_tokens=MAX_TOKENS,
        system=SYSTEM,
        messages=[FIRST, {"role": "assistant", "content": first.content[0].text}, SECOND],
    )
    assert second.content[0].text == unthreaded.content[0].text
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == (
        unthreaded.usage.input_tokens + unthreaded.usage.cache_read_input_tokens
    )


@beta_tool
def get_weather(city: str) -> str:
    """The weather in a city.

    Args:
        city: the city
    """
    return "sunny, 21 C"


def test_the_tool_runner_keeps_its_tools_on_continued_turns(scripted_dir):
    """Before, a continued turn came without its tools, and `tool_choice` was a 400."""
    with serve(Runner.load(scripted_dir)) as scripted:
        client = scripted.anthropic()
        sent = _sent(client)
        runner = client.beta.messages.tool_runner(
            model="m",
            max_tokens=40,
            messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=[get_weather],
            tool_choice={"type": "any"},
            max_iterations=2,
        )
        replies = list(runner)
    assert [reply.stop_reason for reply in replies] == ["tool_use", "tool_use"]
    assert sent[1]["thread"]["type"] == "continue" and "tools" not in sent[1]
    assert replies[1].content[-1].name == WEATHER["function"]["name"]


def test_a_thread_the_server_does_not_hold_is_sent_again_whole(served):
    client = served.anthropic()
    sent = _sent(client)
    thread = client.beta.messages.thread(model="m", max_tokens=MAX_TOKENS, system=SYSTEM)
    first = thread.send(FIRST)
    served.app.state.message_threads = MessageThreads()  # as after a restart
    second = thread.send(SECOND)
    assert [body["thread"]["type"] for body in sent] == ["create", "continue", "create"]
    reply = [{"type": "text", "text": first.content[0].text}]
    assert sent[2]["messages"] == [FIRST, {"role": "assistant", "content": reply}, SECOND]
    assert second.usage.cache_read_input_tokens > 0


def test_the_rejections_in_anthropics_shape(served):
    status, created = served.post(
        "/v1/messages",
        {"model": "m", "max_tokens": 4, "system": SYSTEM, "messages": [FIRST],
         "thread": {"type": "create"}, "cache_salt": "tenant-a"},
    )  # fmt: skip
    assert status == 200
    go_on = {"type": "continue", "previous_message_id": created["id"]}
    unknown = {**go_on, "previous_message_id": "msg_x"}
    cases = {
        "another-tenant": ({"cache_salt": "tenant-b"}, 404, "thread_not_found"),
        "unknown-id": ({"thread": unknown, "cache_salt": "tenant-a"}, 404, "thread_not_found"),
        "system-changed": ({"cache_salt": "tenant-a", "system": "Be brief."}, 400,
                           "thread_fingerprint_mismatch"),
    }  # fmt: skip
    for name, (extra, want_status, code) in cases.items():
        body = {"model": "m", "max_tokens": 4, "messages": [SECOND], "thread": go_on, **extra}
        status, reply = served.post("/v1/messages", body)
        assert (status, reply["error"].get("details")) == (want_status, {"error_code": code}), name
    same = {"cache_salt": "tenant-a", "system": SYSTEM}  # sent again unchanged: taken
    body = {"model": "m", "max_tokens": 4, "messages": [SECOND], "thread": go_on, **same}
    assert served.post("/v1/messages", body)[0] == 200


def test_count_tokens_counts_a_continued_turn_with_its_thread(served):
    status, created = served.post(
        "/v1/messages",
        {"model": "m", "max_tokens": 4, "system": SYSTEM, "messages": [FIRST],
         "thread": {"type": "create"}},
    )  # fmt: skip
    go_on = {"type": "continue", "previous_message_id": created["id"]}
    body = {"model": "m", "messages": [SECOND], "thread": go_on}
    status, counted = served.post("/v1/messages/count_tokens", body)
    status, answered = served.post("/v1/messages", {**body, "max_tokens": 4})
    usage = answered["usage"]
    assert counted["input_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"]


def test_a_long_thread_is_measured_by_what_each_turn_adds(monkeypatch):
    """A turn's size is its thread's plus its own messages', each written out once: before,
    the whole history was written out on every turn (35 ms a turn at 50 MB)."""
    written = []
    dump = Message.model_dump_json
    monkeypatch.setattr(Message, "model_dump_json", lambda m: written.append(m) or dump(m))
    threads, reply = MessageThreads(), [{"type": "text", "text": "Hi"}]
    threads.keep("a", _body("first"), reply)
    for turn, name in enumerate("bcd"):
        continued = MessagesRequest(
            max_tokens=4,
            messages=[{"role": "user", "content": f"turn {turn}"}],
            thread={"type": "continue", "previous_message_id": chr(ord(name) - 1)},
        )
        threads.keep(name, threads.resume(continued), reply)
    assert len(written) == 8  # two messages a turn
    messages = threads._threads.get("d").messages
    head = len(json.dumps([None, None]))  # the thread's system and tools (none)
    assert threads._threads.chars_of("d") == head + sum(len(dump(m)) for m in messages)


def test_a_threads_system_prompt_counts_against_the_bound():
    """A 5-million-character system prompt counted as 90 (its messages alone)."""
    threads = MessageThreads(max_chars=10_000)
    body = MessagesRequest(
        max_tokens=4, messages=[FIRST], system="x" * 20_000, thread={"type": "create"}
    )
    threads.keep("a", body, [{"type": "text", "text": "Hi"}])
    assert threads._threads.get("a") is None  # over the whole bound alone: not kept


def _body(text: str) -> MessagesRequest:
    messages = [{"role": "user", "content": text}]
    return MessagesRequest(max_tokens=4, messages=messages, thread={"type": "create"})


def _holds(threads: MessageThreads, message_id: str) -> bool:
    continued = MessagesRequest(
        max_tokens=4,
        messages=[SECOND],
        thread={"type": "continue", "previous_message_id": message_id},
    )
    try:
        return len(threads.resume(continued).messages) == 3
    except ApiError as error:
        assert error.details == {"error_code": "thread_not_found"}
        return False


def test_threads_are_bounded_the_least_recently_used_dropped_first():
    threads = MessageThreads(max_threads=2)
    reply = [{"type": "text", "text": "Hi"}]
    for name in ("a", "b"):
        threads.keep(name, _body(name), reply)
    assert _holds(threads, "a")  # used: "b" is the oldest now
    threads.keep("c", _body("c"), reply)
    assert [_holds(threads, name) for name in "abc"] == [True, False, True]
