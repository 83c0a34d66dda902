"""The tiny vision-language model every module here runs its tests on, once per family."""

from __future__ import annotations

import pytest

from mlxkv.models.loading import load_model
from mlxkv.testing.vision_factory import FAMILIES, build_vision_model


@pytest.fixture(scope="module", params=FAMILIES)
def loaded(tmp_path_factory, request):
    """A tiny random model of each family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Gemma 3, SmolVLM,
    Idefics3), built and loaded once per module: the reply memory lives as long as the loaded
    model (`mlxkv.runner.text.replies.replies_for`), and one module's replies must not be
    known to another's requests."""
    out = tmp_path_factory.mktemp("vlm") / request.param
    return load_model(build_vision_model(out, family=request.param))
