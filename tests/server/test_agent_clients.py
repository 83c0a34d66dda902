"""What current agent clients send and act on, through the real SDKs: Claude Code's requests
(a system message between turns, a per-session billing header, `thinking`, `output_config`,
`cache_control`, `max_tokens: 0` to pre-warm), the context errors they parse, and streams
that show life before a long prefill ends."""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import threading
from collections.abc import Iterator

import anthropic
import openai
import pytest

from mlxkv import Runner
from mlxkv.runner.scheduling.dispatch import Dispatcher
from mlxkv.server import early_events, state
from tests.server.conftest import held_worker, serve

SYSTEM_PROMPT = "You are a careful coding agent. Read files before you change them. " * 6
LONG_TEXT = "The quick brown fox jumps over the lazy dog. " * 40


@pytest.fixture
def served(loaded_tiny):
    with serve(Runner(loaded_tiny("llama"), max_context=1024)) as served:
        yield served


@pytest.fixture
def small_window(loaded_tiny):
    with serve(Runner(loaded_tiny("llama"), max_context=64)) as served:
        yield served


def _claude_code_system(session: str) -> list[dict]:
    return [
        {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.0; cch={session};"},
        {"type": "text", "text": SYSTEM_PROMPT, "cache_control": {"type": "ephemeral"}},
    ]


def test_claude_code_request_shape_is_served(served):
    client = served.anthropic()
    reply = client.messages.create(
        model="claude-sonnet-4-6",
        max_tokens=8,
        system=_claude_code_system("aaaa"),
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "list the files"}]},
            {"role": "assistant", "content": "Which folder?"},
            {"role": "system", "content": "Reminder: the user works in /src."},
            {"role": "user", "content": "this one"},
        ],
        extra_body={
            "thinking": {"type": "adaptive"},
            "output_config": {"effort": "low"},
            "cache_control": {"type": "ephemeral"},
            "context_management": {"edits": []},
            "diagnostics": {"previous_message_id": "msg_x"},
            "temperature": 0,
        },
        extra_headers={"anthropic-beta": "interleaved-thinking-2025-05-14"},
    )
    assert reply.usage.output_tokens >= 1


def test_a_new_session_reuses_the_system_prompt(served, fresh_runner):
    client = served.anthropic()
    system_tokens = len(fresh_runner().encode([{"role": "system", "content": SYSTEM_PROMPT}]))
    usage = []
    for session in ("first-session", "second-session"):
        reply = client.messages.create(
            model="claude-sonnet-4-6",
            max_tokens=2,
            system=_claude_code_system(session),
            messages=[{"role": "user", "content": f"hello from {session}"}],
        )
        usage.append(reply.usage)
    assert usage[1].cache_read_input_tokens >= system_tokens - 2


def test_max_tokens_0_prewarms_the_cache(served):
    client = served.anthropic()
    messages = [{"role": "user", "content": "Summarize the repository layout for me."}]
    warm = client.messages.create(model="m", max_tokens=0, messages=messages)
    assert warm.content == [] and warm.usage.output_tokens == 0
    assert warm.usage.input_tokens == 0 and warm.usage.cache_creation_input_tokens > 10
    reply = client.messages.create(model="m", max_tokens=3, messages=messages)
    assert reply.usage.input_tokens <= 1  # all but what the prompt's last token must feed
    assert (
        reply.usage.cache_read_input_tokens + reply.usage.input_tokens
        == warm.usage.cache_creation_input_tokens
    )


def test_anthropic_context_errors_in_claude_code_wording(small_window):
    client = small_window.anthropic()
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(
            model="m", max_tokens=4, messages=[{"role": "user", "content": LONG_TEXT}]
        )
    message = raised.value.body["error"]["message"]
    assert re.fullmatch(r"prompt is too long: \d+ tokens > 64 maximum", message)
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(
            model="m", max_tokens=32000, messages=[{"role": "user", "content": "hi"}], timeout=60
        )
    message = raised.value.body["error"]["message"]
    match = re.fullmatch(
        r"input length and `max_tokens` exceed context limit: (\d+) \+ 32000 > 64, "
        r"decrease input length or max_tokens and try again",
        message,
    )
    assert match, message
    assert small_window.runner.cache_info().num_tokens == 0  # refused before any work


def test_openai_context_errors_in_openai_wording(small_window):
    client = small_window.openai()
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model="m", max_tokens=500, messages=[{"role": "user", "content": "hi"}]
        )
    assert raised.value.code == "context_length_exceeded"
    assert re.fullmatch(
        r"This model's maximum context length is 64 tokens\. However, you requested \d+ tokens "
        r"\(\d+ in the messages, 500 in the completion\)\. Please reduce the length of the "
        r"messages or completion\.",
        raised.value.body["message"],
    )


def _filling(runner: Runner, num_tokens: int) -> list[dict]:
    """A user message whose prompt is `num_tokens` long."""
    for words in range(num_tokens):
        messages = [{"role": "user", "content": "fox " * words}]
        if len(runner.encode(messages)) == num_tokens:
            return messages
    raise AssertionError(f"no count of words renders to {num_tokens} tokens")


def test_both_apis_name_the_window_and_a_full_one_leaves_no_room(small_window):
    """Over the window, both APIs quote it (64) as the real ones do; a prompt filling it
    exactly is over by the answer's one token, in each API's sentence with numbers that
    hold (never "64 tokens > 64 maximum")."""
    messages = _filling(small_window.runner, 64)
    with pytest.raises(anthropic.BadRequestError) as raised:
        small_window.anthropic().messages.create(model="m", max_tokens=4, messages=messages)
    assert raised.value.body["error"]["message"] == (
        "input length and `max_tokens` exceed context limit: 64 + 1 > 64, decrease input "
        "length or max_tokens and try again"
    )
    with pytest.raises(openai.BadRequestError) as raised:
        small_window.openai().chat.completions.create(model="m", messages=messages)
    assert raised.value.body["message"] == (
        "This model's maximum context length is 64 tokens. However, you requested 65 tokens "
        "(64 in the messages, 1 in the completion). Please reduce the length of the messages "
        "or completion."
    )
    longer = [{"role": "user", "content": LONG_TEXT}]
    with pytest.raises(openai.BadRequestError) as raised:
        small_window.openai().chat.completions.create(model="m", messages=longer)
    assert raised.value.body["message"].startswith("This model's maximum context length is 64 ")


def test_no_limit_asked_ends_at_the_window_without_a_shift(small_window):
    reply = small_window.openai().chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], temperature=0
    )
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens <= 64


@pytest.fixture
def blocked_worker(served, monkeypatch):
    """The worker busy with another request until the returned event is set (a long prefill
    ahead of ours), and keep-alives every 50 ms."""
    monkeypatch.setattr(state, "KEEPALIVE_INTERVAL_S", 0.05)
    with held_worker(served) as release:
        yield release


@contextlib.contextmanager
def _raw_stream(served, path: str, body: dict) -> Iterator[http.client.HTTPResponse]:
    """The response, read line by line (the SDKs hide pings and comments)."""
    connection = http.client.HTTPConnection(served.host, served.port, timeout=60)
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        yield connection.getresponse()
    finally:
        connection.close()


def _next_event(response: http.client.HTTPResponse) -> bytes:
    """The next server-sent event (or comment), without its blank line."""
    lines = []
    while (line := response.readline()) not in (b"\n", b""):
        lines.append(line)
    return b"".join(lines)


def test_anthropic_stream_pings_while_waiting_then_starts_with_the_counts(served, blocked_worker):
    """While the request waits for its turn, pings (the SDKs drop them, as while a model
    loads); message_start once its prompt is matched, with the counts (Anthropic's order:
    the usage is known when it comes)."""
    body = {
        "model": "m",
        "max_tokens": 3,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    }
    ping = b'event: ping\ndata: {"type": "ping"}\n'
    with _raw_stream(served, "/v1/messages", body) as response:
        assert _next_event(response) == ping
        blocked_worker.set()  # the worker was still busy: nothing else to say until now
        while (event := _next_event(response)) == ping:
            pass
        assert event.startswith(b"event: message_start\n")
        usage = json.loads(event.split(b"data: ", 1)[1])["message"]["usage"]
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] > 0
        rest = response.read().decode()
    assert rest.rstrip().endswith('data: {"type": "message_stop"}')


def test_openai_stream_starts_and_comments_while_waiting(served, blocked_worker):
    body = {
        "model": "m",
        "stream": True,
        "max_tokens": 3,
        "messages": [{"role": "user", "content": "hi"}],
    }
    with _raw_stream(served, "/v1/chat/completions", body) as response:
        first = json.loads(_next_event(response).removeprefix(b"data: "))
        assert first["choices"][0]["delta"]["role"] == "assistant"
        assert _next_event(response) == b": keep-alive\n"
        blocked_worker.set()
        rest = response.read().decode()
    assert rest.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize(
    ("path", "last"),
    [("/v1/messages", 'data: {"type": "message_stop"}'), ("/v1/chat/completions", "data: [DONE]")],
)
def test_a_stream_ends_with_its_last_event_while_the_engine_is_still_busy(
    served, monkeypatch, path, last
):
    """Nothing after the API's last event (a keep-alive there broke clients' end checks):
    the response ends when the reply is whole, not when the Runner's stream, asked for more
    after its last chunk, has ended."""
    monkeypatch.setattr(state, "KEEPALIVE_INTERVAL_S", 0.05)
    read, ended = threading.Event(), threading.Event()
    stream = Dispatcher.stream

    def slow_after_the_last_chunk(self, request, **options):
        for chunk in stream(self, request, **options):
            yield chunk
            if chunk.completion is not None:
                read.wait(30)  # the client has had the whole response by then
        ended.set()

    monkeypatch.setattr(Dispatcher, "stream", slow_after_the_last_chunk)
    body = {"model": "m", "max_tokens": 3, "stream": True}
    body["messages"] = [{"role": "user", "content": "hi"}]
    try:
        with _raw_stream(served, path, body) as response:
            text = response.read().decode()
        assert not ended.is_set()
    finally:
        read.set()
    assert text.rstrip().endswith(last)


def _events_while_held(stream_events, count: int, release: threading.Event):
    """The types of the events an SDK stream yields (`stream_events()`, read on a thread),
    and whether `count` of them came while the worker was held (within 40 keep-alive
    intervals of 50 ms); the worker is released then."""
    events: list[str] = []
    arrived = threading.Event()

    def read() -> None:
        for event in stream_events():
            events.append(event.type)
            if len(events) == count:
                arrived.set()

    reader = threading.Thread(target=read)
    reader.start()
    try:
        seen = arrived.wait(timeout=2.0)
    finally:
        release.set()
        reader.join(timeout=60)
    return events, seen


def test_the_anthropic_sdk_sees_an_event_while_the_prefill_runs(
    served, blocked_worker, monkeypatch
):
    """Claude Code's idle watchdog (`CLAUDE_STREAM_IDLE_TIMEOUT_MS`, 300 s at least) is reset
    only by events its SDK yields, and the SDK drops `ping` (seen: claude -p on a 57k-token
    prompt, cancelled at 300.4 s): a late first token finds an early block open."""
    monkeypatch.setattr(early_events, "EARLY_EVENT_AFTER_S", 0.1)
    client = anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0)

    def stream_events():
        hi = [{"role": "user", "content": "hi"}]
        with client.messages.create(model="m", max_tokens=3, stream=True, messages=hi) as stream:
            yield from stream

    events, seen = _events_while_held(stream_events, 2, blocked_worker)
    assert events[0] == "message_start"
    assert seen, f"only {events[:1]} reached the SDK while the worker was busy"


def test_the_openai_sdk_sees_responses_events_while_the_prefill_runs(
    served, blocked_worker, monkeypatch
):
    """Codex's idle watchdog (`stream_idle_timeout_ms`, 300 s) counts only the events its SSE
    reader yields, not SSE comments: a late first token finds response.in_progress sent
    again (here past response.created and the first in_progress), and the reply after it is
    what it always is."""
    monkeypatch.setattr(early_events, "EARLY_EVENT_AFTER_S", 0.1)
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)

    def stream_events():
        yield from client.responses.create(
            model="m", input="hi", max_output_tokens=3, temperature=0, stream=True
        )

    events, seen = _events_while_held(stream_events, 3, blocked_worker)
    assert seen, f"only {events} reached the SDK while the worker was busy"
    assert events[:3] == ["response.created", "response.in_progress", "response.in_progress"]
    rest = [e for e in events[3:] if e != "response.in_progress"]
    assert rest[0] == "response.output_item.added" and rest[-1] in (
        "response.completed",
        "response.incomplete",
    )
