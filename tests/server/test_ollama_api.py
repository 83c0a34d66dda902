"""Ollama's API through the real `ollama` Python client: the model listed, shown and
"pulled", chat and generate streamed and not, tool calls, options mapped onto sampling, and
errors in Ollama's shape."""

from __future__ import annotations

import httpx
import ollama
import pytest

from mlxkv import Runner
from mlxkv.models.loading import load_model
from mlxkv.server.models.keep_alive import FOREVER, go_duration, keep_alive_ns
from mlxkv.server.ollama_api.protocol import ChatRequest
from tests.server.conftest import WEATHER, serve

QUESTION = [{"role": "user", "content": "Once upon a time there was"}]


@pytest.fixture(scope="module")
def served(loaded_tiny):
    with serve(Runner(loaded_tiny("llama"), max_context=512), model_name="tiny") as served:
        yield served


@pytest.fixture
def client(served):
    return ollama.Client(host=served.url)


def test_the_model_is_listed_shown_and_pulled(client):
    assert [m.model for m in client.list().models] == ["tiny:latest"]
    assert client.show("tiny").modelinfo["llama.context_length"] == 512
    assert client.pull("tiny").status == "success"
    assert [p.status for p in client.pull("tiny:latest", stream=True)][-1] == "success"
    assert client.ps().models[0].context_length == 512
    with pytest.raises(ollama.ResponseError) as missing:
        client.pull("llama3.2")
    assert missing.value.status_code == 404 and "not found" in missing.value.error


def test_chat_plain_and_streamed_agree_with_the_runner(client, fresh_runner):
    options = {"temperature": 0, "num_predict": 6}
    plain = client.chat(model="tiny", messages=QUESTION, options=options)
    streamed = list(client.chat(model="tiny", messages=QUESTION, options=options, stream=True))
    want = fresh_runner().generate(QUESTION, max_tokens=6)
    assert plain.message.content == want.text
    assert "".join(part.message.content for part in streamed) == want.text
    assert streamed[-1].done and streamed[-1].done_reason == plain.done_reason == "length"
    assert plain.eval_count == 6 and plain.prompt_eval_count == want.prompt_tokens


def test_generate_plain_and_streamed(client, fresh_runner):
    options = {"temperature": 0, "num_predict": 5}
    plain = client.generate(model="tiny", prompt="Hello there", system="Be brief.", options=options)
    streamed = list(client.generate(model="tiny", prompt="Hello there", system="Be brief.",
                                    options=options, stream=True))  # fmt: skip
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    assert plain.response == fresh_runner().generate(chat, max_tokens=5).text
    assert "".join(part.response for part in streamed) == plain.response
    assert client.generate(model="tiny", prompt="").done_reason == "load"


def test_tool_calls_come_back_as_objects_with_ids(scripted_dir):
    """With an id, as Ollama sends: a client sends it back for the template to render."""
    messages = [{"role": "user", "content": "Weather?"}]
    with serve(Runner(load_model(scripted_dir), max_context=1024)) as served:
        reply = ollama.Client(host=served.url).chat(model="m", messages=messages, tools=[WEATHER])
        body = {"model": "m", "messages": messages, "tools": [WEATHER], "stream": False}
        raw = httpx.post(f"{served.url}/api/chat", json=body).json()
    (call,) = reply.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    assert raw["message"]["tool_calls"][0]["id"].startswith("call_")


@pytest.mark.parametrize(
    ("call", "status", "mentions"),
    [
        (lambda c: c.embed(model="tiny", input="hi", dimensions=9999), 400, "dimensions"),
        (lambda c: c.chat(model="tiny", messages=QUESTION, format={"type": "nonsense"}), 400,
         "nonsense"),
        (lambda c: c.chat(model="tiny", messages=[{"role": "user", "content": "x",
                                                   "images": ["aGk="]}]), 400, "images"),
        (lambda c: c.chat(model="tiny", messages=QUESTION, options={"temperature": -1}), 400,
         "temperature"),
    ],
    ids=["embed", "bad-schema", "images", "bad-option"],
)  # fmt: skip
def test_errors_in_ollamas_shape(client, call, status, mentions):
    with pytest.raises(ollama.ResponseError) as raised:
        call(client)
    assert raised.value.status_code == status and mentions in raised.value.error


@pytest.mark.parametrize(("num_predict", "max_tokens"), [
    (None, 1024), (-1, 4096), (-2, 4096), (7, 7),
], ids=["unset", "no-limit", "fill-context", "set"])  # fmt: skip
def test_num_predict_maps_onto_max_tokens(num_predict, max_tokens):
    body = ChatRequest(model="m", messages=[], options={"num_predict": num_predict})
    assert body.sampling(default_max_tokens=1024, window=4096)["max_tokens"] == max_tokens


@pytest.mark.parametrize(
    ("text", "nanoseconds"),
    [
        ("0", 0), ("+0", 0), ("0m0s", 0), (".5s", 500_000_000), ("1.s", 1_000_000_000),
        ("1h30m", 5_400_000_000_000), ("1µs", 1_000), ("1μs", 1_000), ("-1.5m", -90_000_000_000),
        ("0.0000000001s", 0), ("9223372036854775807ns", (1 << 63) - 1),
        ("-9223372036854775808ns", -(1 << 63)), ("2562047h47m16.854775807s", (1 << 63) - 1),
        ("9223372036854775808ns", None), ("2562047h47m16.854775808s", None), (".", None),
        ("-", None), ("3", None), ("1e3s", None),
    ],
)  # fmt: skip
def test_keep_alive_strings_are_read_as_go_reads_durations(text, nanoseconds):
    """Go's own table (time_test.go's parseDurationTests): the values and the refusals."""
    if nanoseconds is None:
        with pytest.raises(ValueError, match="^time: "):
            go_duration(text)
    else:
        assert go_duration(text) == nanoseconds


@pytest.mark.parametrize(
    ("value", "nanoseconds"),
    [(0.0, 0), (5, 5_000_000_000), (-1, FOREVER), (1e300, FOREVER), (10**30, FOREVER),
     (1e400, None), (float("nan"), None)],
    ids=["zero", "seconds", "negative", "huge-float", "huge-int", "infinite", "nan"],
)  # fmt: skip
def test_keep_alive_numbers_are_seconds_and_never_overflow(value, nanoseconds):
    """Python's JSON reads 1e400 and NaN (Go's refuses them): a clear refusal, not a 500."""
    if nanoseconds is None:
        with pytest.raises(ValueError, match="finite number of seconds"):
            keep_alive_ns(value)
    else:
        assert keep_alive_ns(value) == nanoseconds


def test_a_keep_alive_of_many_terms_is_read_in_one_pass():
    """A body may carry megabytes: 200,000 terms read at once (each term once; the message of
    a refusal is made only when refusing)."""
    assert go_duration("0s" * 200_000) == 0
    assert go_duration("1ns" * 200_000) == 200_000
    with pytest.raises(ValueError, match="missing unit"):
        go_duration("1ns" * 200_000 + "1")
