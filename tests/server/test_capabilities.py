"""Capabilities as the template and the grammar make them: a template that drops its tools
(as SmolLM2's) has no `tools`, one that renders them has; every model has forced tool calls;
`/api/show`, `/v1/models` and `mlxkv info` say the same."""

from __future__ import annotations

import ollama
import pytest

from mlxkv import Runner
from mlxkv.models.capabilities import model_capabilities
from mlxkv.models.inspect import describe
from mlxkv.models.loading import load_model
from tests.server.conftest import THINKING_TEMPLATE, build_template_model, serve

TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]


@pytest.fixture(scope="module")
def plain(loaded_tiny):
    """The factory's plain chat template: it never renders tools."""
    with serve(Runner(loaded_tiny("llama"), max_context=256), model_name="m") as served:
        yield served


@pytest.fixture(scope="module")
def thinking_tools(tmp_path_factory):
    """Qwen3's form: tools rendered, `<tool_call>` JSON calls, thinking tags."""
    script = ("<think>", "Hmm.", "</think>", "Hi")  # the tags in the vocabulary: thinking
    path = build_template_model(tmp_path_factory.mktemp("qwen") / "m", script, THINKING_TEMPLATE)
    with serve(Runner(load_model(path), max_context=256)) as served:
        yield served


def test_a_template_that_drops_tools_has_no_tools(plain):
    tokenizer = plain.runner.tokenizer
    ask = [{"role": "user", "content": "Hi"}]
    assert plain.runner.encode(ask, tools=TOOLS) == plain.runner.encode(ask)  # the case at hand
    assert ollama.Client(host=plain.url).show("m").capabilities == ["completion"]
    (model,) = plain.openai().models.list().data
    assert model.capabilities == ["completion", "forced_tool_calls"]
    assert model.tool_call_format is None
    facts = describe(plain.runner.loaded)
    assert facts["capabilities"] == "completion, forced_tool_calls"
    assert facts["tool-call format"].startswith("none")
    assert not model_capabilities(tokenizer).tools


def test_a_template_that_renders_tools_has_them(thinking_tools):
    show = ollama.Client(host=thinking_tools.url).show("m")
    assert show.capabilities == ["completion", "tools", "thinking"]
    (model,) = thinking_tools.openai().models.list().data
    assert model.capabilities == ["completion", "tools", "forced_tool_calls", "thinking"]
    assert model.tool_call_format == "json_tools"
    assert describe(thinking_tools.runner.loaded)["tool-call format"] == "json_tools"


def test_the_warning_says_where_the_tools_went(plain, caplog):
    plain.openai().chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], tools=TOOLS, max_tokens=1
    )
    warned = [r.getMessage() for r in caplog.records if "tool-call format" in r.getMessage()]
    assert not warned or "leaves the tools out" in warned[0]  # once a process


def test_a_vision_model_lists_vision_everywhere(tmp_path_factory):
    """Issue 44: capabilities "images once they exist", the same in `/api/show` (Ollama's
    word: `vision`, which Ollama clients read before sending images), `/v1/models` and
    `mlxkv info`, and in a listing read before the model loads."""
    pytest.importorskip("mlx_vlm")
    from mlxkv.models.capabilities import read_template_facts
    from mlxkv.testing.vision_factory import build_vision_model

    path = build_vision_model(tmp_path_factory.mktemp("vl") / "m")
    assert "vision" in read_template_facts(path).capabilities.names()
    runner = Runner(load_model(path), max_context=256)
    with serve(runner) as served:
        assert "vision" in ollama.Client(host=served.url).show("m").capabilities
        (model,) = served.openai().models.list().data
        assert "vision" in model.capabilities
    assert "vision" in describe(runner.loaded)["capabilities"]
