"""Several models behind one server, chosen by the request's `model`: each answers exactly as
a fresh Runner of that model alone, keeps its own prompt cache (a conversation on A after
requests to B still reuses A's), an alias pattern reaches its model, an unknown name is a 404
in each API's shape listing the names served, and the listings show every model."""

from __future__ import annotations

import numpy as np
import ollama
import openai
import pytest

from mlxkv import Runner
from tests.server.conftest import serve

QUESTION = [{"role": "user", "content": "Once upon a time there was"}]
ARCHS = {"a": "llama", "b": "qwen3"}


@pytest.fixture(scope="module")
def served(loaded_tiny):
    runners = {name: Runner(loaded_tiny(arch), max_context=512) for name, arch in ARCHS.items()}
    with serve(runners, model_aliases=("claude-*=b",)) as served:
        yield served


@pytest.fixture
def alone(loaded_tiny):
    """An independent reference: a fresh Runner of one model, with an empty cache."""
    return lambda name: Runner(loaded_tiny(ARCHS[name]), max_context=512)


def _logprobs(reply) -> list[float]:
    return [token.logprob for token in reply.choices[0].logprobs.content]


@pytest.mark.parametrize("name", ["a", "b"])
def test_each_model_answers_as_it_does_alone(served, alone, name):
    client = served.openai()
    reply = client.chat.completions.create(
        model=name, messages=QUESTION, max_tokens=6, temperature=0, logprobs=True
    )
    want = [chunk for chunk in alone(name).stream(QUESTION, max_tokens=6, logprobs=0)]
    assert reply.model == name
    assert reply.choices[0].message.content == want[-1].completion.text
    got, expected = _logprobs(reply), [c.logprob.logprob for c in want if c.logprob]
    np.testing.assert_allclose(got, expected[: len(got)], atol=1e-4)
    ollama_reply = ollama.Client(host=served.url).chat(
        model=f"{name}:latest", messages=QUESTION, options={"temperature": 0, "num_predict": 6}
    )
    assert ollama_reply.message.content == want[-1].completion.text


def test_the_models_differ(served):
    client = served.openai()
    texts = {
        name: client.chat.completions.create(
            model=name, messages=QUESTION, max_tokens=8, temperature=0
        )
        .choices[0]
        .message.content
        for name in ARCHS
    }
    assert texts["a"] != texts["b"]


def test_a_conversation_on_a_after_requests_to_b_hits_as_cache(served):
    client = served.openai()
    first = client.chat.completions.create(model="a", messages=QUESTION, max_tokens=4)
    for _ in range(2):
        client.chat.completions.create(model="b", messages=QUESTION, max_tokens=4)
    history = [*QUESTION, {"role": "assistant", "content": first.choices[0].message.content}]
    follow = [*history, {"role": "user", "content": "And then?"}]
    second = client.chat.completions.create(model="a", messages=follow, max_tokens=4)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1


def test_an_alias_pattern_reaches_its_model(served, alone):
    body = {"model": "claude-sonnet-4-5", "max_tokens": 6, "messages": QUESTION, "temperature": 0}
    status, reply = served.post("/v1/messages", body)
    assert status == 200 and reply["model"] == "b"  # the model that answered
    assert reply["content"][0]["text"] == alone("b").generate(QUESTION, max_tokens=6).text


def test_an_unknown_name_is_a_404_in_each_apis_shape(served):
    with pytest.raises(openai.NotFoundError, match="serves: a, b") as unknown:
        served.openai().chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert unknown.value.code == "model_not_found"  # OpenAI's code, as models.retrieve's
    with pytest.raises(ollama.ResponseError, match="serves: a, b") as missing:
        ollama.Client(host=served.url).chat(model="llama3.2", messages=QUESTION)
    assert missing.value.status_code == 404
    status, body = served.post("/v1/messages", {"model": "gpt-4o", "max_tokens": 4,
                                                "messages": QUESTION})  # fmt: skip
    assert status == 404 and body["error"]["type"] == "not_found_error"
    status, body = served.post("/v1/embeddings", {"model": "nope", "input": "x"})
    assert status == 404 and "serves: a, b" in body["error"]["message"]


def test_the_listings_show_every_model(served):
    assert [m.id for m in served.openai().models.list()] == ["a", "b"]
    client = ollama.Client(host=served.url)
    assert [m.model for m in client.list().models] == ["a:latest", "b:latest"]
    assert [m.model for m in client.ps().models] == ["a:latest", "b:latest"]


def test_embeddings_come_from_the_named_model(served, alone):
    reply = served.openai().embeddings.create(model="b", input="Paris", encoding_format="float")
    np.testing.assert_allclose(reply.data[0].embedding, alone("b").embed("Paris").vectors[0],
                               atol=1e-5)  # fmt: skip


def test_a_bad_alias_is_refused_when_the_app_is_made(loaded_tiny):
    from mlxkv.server import create_app

    with pytest.raises(ValueError, match="NAME one of: a"):
        create_app({"a": Runner(loaded_tiny("llama"))}, model_aliases=("claude-*=coder",))


def test_the_access_line_carries_the_memory_of_the_model_that_answered(served, access_log):
    longer = [{"role": "user", "content": "Once upon a time " * 20}]  # a's cache grows more
    for name, question in (("a", longer), ("b", QUESTION)):
        served.openai().chat.completions.create(model=name, messages=question, max_tokens=3)
    line = access_log(r"POST /v1/chat/completions 200 .* \| (.*)$", count=2).group(1)
    a, b = served.runner["a"].memory_line, served.runner["b"].memory_line
    assert a != b and line == b


def test_the_cache_report_names_its_model(served):
    """`/v1/mlxkv/cache?model=` reports the model it names (the default without it): each
    model's own cache; a 404 in OpenAI's shape for a name not served."""
    served.openai().chat.completions.create(
        model="b", messages=[{"role": "user", "content": "cached in b only, once"}], max_tokens=2
    )
    reports = {name: served.request("GET", f"/v1/mlxkv/cache?model={name}") for name in ARCHS}
    default = served.request("GET", "/v1/mlxkv/cache")
    assert [status for status, _ in reports.values()] == [200, 200]
    assert {name: body["model"] for name, (_, body) in reports.items()} == {"a": "a", "b": "b"}
    assert default[1]["model"] == "a"
    assert reports["b"][1]["num_tokens"] != reports["a"][1]["num_tokens"]
    status, body = served.request("GET", "/v1/mlxkv/cache?model=nope")
    assert status == 404 and "nope" in body["error"]["message"]


def test_ollama_names_take_the_latest_tag_once(loaded_tiny):
    """A model served by an Ollama name that holds its tag ("tiny:latest", as `--models-dir`
    names a model pulled with Ollama) is listed as is (not "tiny:latest:latest"), and a
    request for "tiny" reaches it, as Ollama reads a name without a tag as ":latest" (served
    alone too: `/api/show` checks the name)."""
    runners = {"tiny:latest": Runner(loaded_tiny("llama")), "b": Runner(loaded_tiny("qwen3"))}
    alone = Runner(loaded_tiny("llama")).generate(QUESTION, max_tokens=4, temperature=0)
    options = {"temperature": 0, "num_predict": 4}
    with serve(runners) as served:
        client = ollama.Client(host=served.url)
        assert [m.model for m in client.list().models] == ["tiny:latest", "b:latest"]
        for name in ("tiny", "tiny:latest"):
            reply = client.chat(model=name, messages=QUESTION, options=options)
            assert reply.message.content == alone.text, name
    with serve({"tiny:latest": runners["tiny:latest"]}) as alone_served:
        for name in ("tiny", "tiny:latest"):
            assert alone_served.post("/api/show", {"model": name})[0] == 200, name
        assert alone_served.post("/api/show", {"model": "tiny:1b"})[0] == 404
