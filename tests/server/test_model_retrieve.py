"""`GET /v1/models/{id}`: every name `/v1/models` lists, and every name a request may give
(an Ollama name with its tag, an alias), answers the listed object through the real `openai`
client's `models.retrieve`; any other name is a 404 in OpenAI's shape, even with one model
served (a request's `model` then reaches that model whatever it says, a lookup does not)."""

from __future__ import annotations

import openai
import pytest

from mlxkv import Runner
from tests.server.conftest import serve

ARCHS = {"a": "llama", "b": "qwen3"}


@pytest.fixture(scope="module")
def served(loaded_tiny):
    runners = {name: Runner(loaded_tiny(arch), max_context=256) for name, arch in ARCHS.items()}
    with serve(runners, model_aliases=("claude-*=b",)) as served:
        yield served


def test_every_listed_model_is_retrieved_as_listed(served):
    client = served.openai()
    listed = {model.id: model.model_dump() for model in client.models.list()}
    assert set(listed) == set(ARCHS)
    for name, model in listed.items():
        assert client.models.retrieve(name).model_dump() == model


@pytest.mark.parametrize(("asked", "name"), [("b:latest", "b"), ("claude-x", "b")])
def test_a_name_a_request_may_give_retrieves_its_model(served, asked, name):
    assert served.openai().models.retrieve(asked).id == name


def test_an_unknown_name_is_a_404_in_openais_shape(served):
    with pytest.raises(openai.NotFoundError) as raised:
        served.openai().models.retrieve("nonesuch")
    error = raised.value.body
    # OpenAI's own body: {"type": "invalid_request_error", "code": "model_not_found"}
    assert error["type"] == "invalid_request_error" and error["code"] == "model_not_found"
    assert "nonesuch" in error["message"] and "a, b" in error["message"]


def test_one_served_model_answers_only_to_its_names(loaded_tiny):
    with serve({"solo": Runner(loaded_tiny("llama"), max_context=256)}) as served:
        client = served.openai()
        assert client.models.retrieve("solo").id == "solo"
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("other")
