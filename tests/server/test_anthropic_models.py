"""`GET /v1/models` and `/v1/models/{id}` asked by Anthropic's clients (they send
`anthropic-version`) answer in Anthropic's shape (`{"data": [{"type": "model", "id",
"display_name", "created_at"}], "has_more", "first_id", "last_id"}`, paged by `limit`,
`after_id` and `before_id`), through the real `anthropic` client; its 404s and 400s are
Anthropic's errors. Without that header the same paths answer in OpenAI's shape."""

from __future__ import annotations

from datetime import datetime, timezone

import anthropic
import pytest

from mlxkv import Runner
from tests.server.conftest import serve

NAMES = ("a", "b", "c")


@pytest.fixture(scope="module")
def served(loaded_tiny):
    runners = {name: Runner(loaded_tiny("llama"), max_context=256) for name in NAMES}
    with serve(runners, model_aliases=("claude-*=b",)) as served:
        yield served


def test_the_listing_is_anthropics(served):
    page = served.anthropic().models.list()
    assert [model.id for model in page.data] == list(NAMES)
    assert (page.has_more, page.first_id, page.last_id) == (False, "a", "c")
    openai_created = {model.id: model.created for model in served.openai().models.list()}
    for model in page.data:
        assert model.type == "model" and model.display_name == model.id
        assert model.created_at == datetime.fromtimestamp(openai_created[model.id], timezone.utc)


def test_the_listing_pages_as_anthropics(served):
    client = served.anthropic()
    first = client.models.list(limit=2)
    assert [m.id for m in first.data] == ["a", "b"] and first.has_more and first.last_id == "b"
    # the SDK's auto-paging walks every page by after_id
    assert [model.id for model in client.models.list(limit=1)] == list(NAMES)
    after = client.models.list(limit=2, after_id="a")
    assert [m.id for m in after.data] == ["b", "c"] and not after.has_more
    before = client.models.list(limit=1, before_id="c")
    assert [m.id for m in before.data] == ["b"] and before.has_more


@pytest.mark.parametrize(("asked", "name"), [("b", "b"), ("b:latest", "b"), ("claude-x", "b")])
def test_a_model_is_retrieved_in_anthropics_shape(served, asked, name):
    model = served.anthropic().models.retrieve(asked)
    assert (model.id, model.type, model.display_name) == (name, "model", name)
    assert model.created_at.year >= 2024


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda models: models.retrieve("nonesuch"), anthropic.NotFoundError),
        (lambda models: models.list(after_id="nonesuch"), anthropic.BadRequestError),
        (lambda models: models.list(limit=0), anthropic.BadRequestError),
    ],
    ids=["unknown-model", "unknown-cursor", "limit-0"],
)
def test_errors_are_anthropics(served, call, error):
    with pytest.raises(error) as raised:
        call(served.anthropic().models)
    body = raised.value.body
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] in {"not_found_error", "invalid_request_error"}


def test_without_anthropic_version_the_answer_is_openais(served):
    status, body = served.request("GET", "/v1/models")
    assert status == 200 and body["object"] == "list" and body["data"][0]["object"] == "model"
    status, body = served.request("GET", "/v1/models/nonesuch")
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_a_wrong_key_is_refused_in_each_clients_shape(loaded_tiny):
    with serve(Runner(loaded_tiny("llama"), max_context=256), api_key="s3cret") as served:
        with pytest.raises(anthropic.AuthenticationError) as raised:
            served.anthropic(api_key="wrong").models.list()
        assert raised.value.body["type"] == "error"  # Anthropic's shape, not OpenAI's
        assert served.anthropic(api_key="s3cret").models.list().data[0].type == "model"
        status, body = served.request("GET", "/v1/models")
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
