"""The listings tell what a served model can do before its first load, read from its tokenizer
files alone: `/v1/models`, `/api/tags` and `/api/show` say the same before and after the load
(`/api/tags` the weights' size, not the load's estimate with its cache budget), and none of
them loads it (`/api/show` included)."""

from __future__ import annotations

import threading

import httpx
import ollama
import pytest

from mlxkv import Runner
from mlxkv.models.loading import expected_weights_bytes
from mlxkv.server.models.model import ModelLoader
from tests.factories import tiny_model_dir
from tests.server.conftest import serve

QUESTION = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def served(model_root, scripted_dir):
    """A model whose template shows tools (and writes calls mlx-lm parses) and one whose
    template does not, each counting its loads."""
    paths = {"tools": scripted_dir, "plain": tiny_model_dir("llama", model_root)}
    loads = {name: 0 for name in paths}
    lock = threading.Lock()

    def loader(name: str) -> ModelLoader:
        def load() -> Runner:
            with lock:
                loads[name] += 1
            return Runner.load(str(paths[name]), max_context=512)

        weights_bytes, cache_budget_bytes = expected_weights_bytes(paths[name]), 1 << 30
        return ModelLoader(load, weights_bytes + cache_budget_bytes, paths[name], weights_bytes)

    with serve({name: loader(name) for name in paths}) as served:
        served.loads = loads
        yield served


def _listings(served) -> dict:
    client = ollama.Client(host=served.url)
    shown = {}
    for name in served.loads:
        show = httpx.post(f"{served.url}/api/show", json={"model": name}).json()
        shown[name] = {key: show[key] for key in ("capabilities", "template", "details")} | {
            "architecture": show["model_info"]["general.architecture"]
        }
    return {
        "openai": {
            m.id: (m.capabilities, m.tool_call_format) for m in served.openai().models.list()
        },
        "tags": {m.model: (m.details.family, m.size) for m in client.list().models},
        "show": shown,
    }


def test_listings_before_the_first_load_equal_those_after(served):
    before = _listings(served)
    assert served.loads == {"tools": 0, "plain": 0}
    assert ollama.Client(host=served.url).ps().models == []
    assert "tools" in before["show"]["tools"]["capabilities"]
    assert "tools" not in before["show"]["plain"]["capabilities"]
    assert before["openai"]["tools"][1] is not None
    assert before["show"]["tools"]["template"]
    assert before["tags"]["plain:latest"][0] == "llama"
    for name in served.loads:
        served.openai().chat.completions.create(model=name, messages=QUESTION, max_tokens=2)
    assert served.loads == {"tools": 1, "plain": 1}
    assert _listings(served) == before


@pytest.mark.parametrize(
    ("name", "files"),
    [
        ("invalid-config", {"config.json": '{"model_type": "llama", "hidden_size": -5}'}),
        ("config-a-list", {"config.json": "[]"}),
        ("broken-tokenizer", {"config.json": '{"model_type": "llama"}', "tokenizer.json": "{"}),
    ],
    ids=["invalid-config", "config-a-list", "broken-tokenizer"],
)
def test_a_broken_model_directory_leaves_the_listings_whole(model_root, tmp_path, name, files):
    """A directory of a models dir whose files cannot be read lists with nothing known about
    it (its load says why): the listings of every other model still answer."""
    broken = tmp_path / name
    broken.mkdir()
    for file, text in files.items():
        (broken / file).write_text(text)
    plain = tiny_model_dir("llama", model_root)
    sources = {
        "plain": ModelLoader(lambda: Runner.load(str(plain), max_context=512), path=plain),
        name: ModelLoader(lambda: Runner.load(str(broken)), path=broken),
    }
    with serve(sources) as served:
        assert [m.model for m in ollama.Client(host=served.url).list().models] == [
            "plain:latest",
            f"{name}:latest",
        ]
        assert [m.id for m in served.openai().models.list()] == ["plain", name]
        shown = httpx.post(f"{served.url}/api/show", json={"model": name})
        assert shown.status_code == 200
