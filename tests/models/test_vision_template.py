"""A vision model whose chat template is only its processor's (a `chat_template.json` beside a
tokenizer config without one, as Qwen2-VL's repositories ship it) renders chats with that
template, as the same model with the template in its tokenizer config does."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("mlx_vlm")

from mlxkv.models.loading import load_model  # noqa: E402
from mlxkv.testing.vision_factory import build_vision_model  # noqa: E402

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


def test_a_template_only_the_processor_has_renders_the_chat(tmp_path):
    reference = load_model(build_vision_model(tmp_path / "in_tokenizer")).tokenizer
    moved = build_vision_model(tmp_path / "in_processor")
    settings = json.loads((moved / "tokenizer_config.json").read_text())
    template = settings.pop("chat_template")
    (moved / "tokenizer_config.json").write_text(json.dumps(settings))
    (moved / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    tokenizer = load_model(moved).tokenizer
    want = reference.apply_chat_template(CHAT, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(CHAT, add_generation_prompt=True) == want
