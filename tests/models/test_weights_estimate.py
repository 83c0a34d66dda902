"""Review probes of `expected_weights_bytes` (merge 9e209a7), the bytes `mlxkv serve` expects a
model's weights to take before it loads it (a 507 refuses a model over the budget by it):
against the parameters' bytes once `load_model` has loaded the model on this CPU, within 10%.
bf16, 4-bit mlx quantized (packed uint32 and half-precision scales and biases), sharded with an
index, vision models, and a folder that holds other safetensors files beside the model's."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from mlxkv.models.loading import expected_weights_bytes, load_model
from mlxkv.testing.factory import build_model


def _loaded_bytes(path) -> int:
    model = load_model(path).model
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def _assert_close(path) -> None:
    estimate, loaded = expected_weights_bytes(path), _loaded_bytes(path)
    assert 0.9 * loaded <= estimate <= 1.1 * loaded, (estimate, loaded)


@pytest.fixture
def base(tmp_path):
    return build_model("llama", tmp_path / "base")


def _cast(base, out, dtype):
    shutil.copytree(base, out)
    weights = mx.load(str(out / "model.safetensors"))
    mx.save_safetensors(
        str(out / "model.safetensors"), {k: v.astype(dtype) for k, v in weights.items()}
    )
    return out


def test_bf16(base, tmp_path):
    _assert_close(_cast(base, tmp_path / "bf16", mx.bfloat16))


def test_4_bit_mlx_quantized(base, tmp_path):
    from mlx_lm.utils import load

    out = tmp_path / "q4"
    shutil.copytree(base, out)
    model, _, config = load(str(base), return_config=True)
    model.set_dtype(mx.float16)
    nn.quantize(model, group_size=32, bits=4)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config["quantization"] = {"group_size": 32, "bits": 4}
    (out / "config.json").write_text(json.dumps(config))
    _assert_close(out)


def test_sharded_with_an_index(base, tmp_path):
    out = _cast(base, tmp_path / "sharded", mx.float16)
    weights = mx.load(str(out / "model.safetensors"))
    (out / "model.safetensors").unlink()
    keys = sorted(weights)
    index = {"metadata": {}, "weight_map": {}}
    for i, part in enumerate([keys[: len(keys) // 2], keys[len(keys) // 2 :]]):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        mx.save_safetensors(str(out / name), {k: weights[k] for k in part})
        index["weight_map"].update(dict.fromkeys(part, name))
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    _assert_close(out)


def test_a_folder_with_a_consolidated_copy_beside_the_model_files(base, tmp_path):
    """Mistral's repos ship `consolidated.safetensors` (the same weights in its own layout)
    beside `model-*.safetensors`; mlx-lm loads only `model*.safetensors`. Counting every
    `*.safetensors` doubles the estimate: a model that fits is refused with a 507 (and others
    are unloaded to make room it does not need)."""
    out = _cast(base, tmp_path / "consolidated", mx.float16)
    shutil.copy(out / "model.safetensors", out / "consolidated.safetensors")
    _assert_close(out)


@pytest.mark.parametrize("family", ["qwen2_vl", "gemma3", "smolvlm"])
def test_vision_models(tmp_path, family):
    pytest.importorskip("mlx_vlm")
    from mlxkv.testing.vision_factory import build_vision_model

    _assert_close(build_vision_model(tmp_path / family, family=family))


def test_an_encoder_model(tmp_path):
    pytest.importorskip("mlx_embeddings")
    from mlxkv.testing.encoder_factory import build_encoder_model

    _assert_close(build_encoder_model(tmp_path / "tiny-bert"))


def test_a_tied_checkpoint_that_still_stores_the_head(base, tmp_path):
    """A config with `tie_word_embeddings` whose checkpoint still holds `lm_head.weight` (some
    converted repos do): the loader drops it (the head is the embedding), so it is not counted.
    The factory's head is a large share of a tiny model: counted, the estimate is 1.3x."""
    out = tmp_path / "tied"
    shutil.copytree(base, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    assert "lm_head.weight" in mx.load(str(out / "model.safetensors"))
    _assert_close(out)
