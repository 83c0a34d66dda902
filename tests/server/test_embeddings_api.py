"""Embeddings over HTTP through the real `openai` and `ollama` clients: the vectors the Runner
gives (floats and base64 alike), batches equal to one by one, usage counting tokens, and bad
input or a model that cannot embed answered 400 in each API's shape."""

from __future__ import annotations

import numpy as np
import ollama
import openai
import pytest

from mlxkv import Runner
from tests.server.conftest import serve

TEXTS = ["hello there", "The quick brown fox jumps over the lazy dog.", "Paris"]
ATOL = 1e-5  # float32; batched and single forward passes differ in summation order only


@pytest.fixture(scope="module")
def served(loaded_tiny):
    with serve(Runner(loaded_tiny("llama"), max_context=32), model_name="tiny") as served:
        yield served


@pytest.fixture(scope="module")
def reference(loaded_tiny):
    """An independent Runner on the same weights: the vectors the server must give."""
    return Runner(loaded_tiny("llama"), max_context=32)


def test_openai_embeddings_are_the_runners_as_floats_and_base64(served, reference):
    client = served.openai()
    want = reference.embed(TEXTS)
    as_floats = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    as_base64 = client.embeddings.create(model="tiny", input=TEXTS)  # the client's default
    for reply in (as_floats, as_base64):
        got = np.array([item.embedding for item in reply.data])
        np.testing.assert_allclose(got, want.vectors, atol=ATOL)
        assert [item.index for item in reply.data] == [0, 1, 2] and reply.model == "tiny"
        assert reply.usage.prompt_tokens == reply.usage.total_tokens == want.num_tokens
    one = client.embeddings.create(model="tiny", input=TEXTS[1])
    np.testing.assert_allclose(one.data[0].embedding, want.vectors[1], atol=ATOL)


def test_openai_takes_token_ids_and_dimensions(served, reference):
    client = served.openai()
    ids = [reference.encode(text) for text in TEXTS]
    reply = client.embeddings.create(model="tiny", input=ids, dimensions=8)
    got = np.array([item.embedding for item in reply.data])
    np.testing.assert_allclose(got, reference.embed(ids, dimensions=8).vectors, atol=ATOL)
    assert got.shape == (3, 8)


def test_ollama_embed_and_the_older_embeddings(served, reference):
    client = ollama.Client(host=served.url)
    want = reference.embed(TEXTS)
    reply = client.embed(model="tiny", input=TEXTS)
    np.testing.assert_allclose(np.array(reply.embeddings), want.vectors, atol=ATOL)
    assert reply.prompt_eval_count == want.num_tokens
    older = client.embeddings(model="tiny", prompt=TEXTS[0])
    np.testing.assert_allclose(older.embedding, want.vectors[0], atol=ATOL)
    assert client.embed(model="tiny", input=[]).embeddings == []  # a load: nothing embedded


def test_ollama_truncates_by_default_and_openai_refuses(served):
    long = " ".join(["word"] * 60)
    cut = ollama.Client(host=served.url).embed(model="tiny", input=long)
    assert cut.prompt_eval_count == 32
    with pytest.raises(ollama.ResponseError, match="at most 32 tokens"):
        ollama.Client(host=served.url).embed(model="tiny", input=long, truncate=False)
    with pytest.raises(openai.BadRequestError) as refused:
        served.openai().embeddings.create(model="tiny", input=long)
    assert refused.value.code == "context_length_exceeded"


@pytest.mark.parametrize(
    ("body", "mentions"),
    [
        ({"model": "tiny", "input": []}, "inputs must be"),
        ({"model": "tiny", "input": ["a", ""]}, "input 1 is an empty string"),
        ({"model": "tiny", "input": "a", "dimensions": 65}, "(model 'tiny' gives 64-"),
        ({"model": "tiny", "input": [[1, 99999]]}, "outside the vocabulary"),
        ({"model": "tiny", "input": "a", "encoding_format": "int8"}, "encoding_format"),
    ],
)
def test_bad_openai_input_is_a_400_naming_the_field(served, body, mentions):
    status, reply = served.post("/v1/embeddings", body)
    assert status == 400 and mentions in reply["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/embeddings", "/api/embed"])
def test_more_inputs_than_the_limit_is_a_400_before_any_work(served, path):
    """190,000 one-letter inputs (a 760 KB body) took the server to 7.9 GiB: refused by
    count, in each API's shape; as many as the limit are embedded."""
    status, reply = served.post(path, {"model": "tiny", "input": ["a"] * 2049})
    message = reply["error"]["message"] if path.startswith("/v1/") else reply["error"]
    assert status == 400 and "2,049 inputs" in message and "at most 2,048" in message
    status, reply = served.post(path, {"model": "tiny", "input": ["a"] * 2048})
    assert status == 200 and len(reply["data" if path.startswith("/v1/") else "embeddings"]) == 2048


def test_a_model_that_cannot_embed_is_a_400_naming_it(loaded_tiny):
    """Named as the client names it (served as "notes"), not by its directory ("mamba")."""
    with serve(Runner(loaded_tiny("mamba"), max_context=32), model_name="notes") as served:
        with pytest.raises(openai.BadRequestError, match="model 'notes'.*cannot compute"):
            served.openai().embeddings.create(model="notes", input="hi")
        with pytest.raises(ollama.ResponseError, match="model 'notes'.*cannot compute") as no:
            ollama.Client(host=served.url).embed(model="notes", input="hi")
        assert no.value.status_code == 400
        assert served.post("/api/chat", {"model": "notes", "messages": []})[0] == 200
