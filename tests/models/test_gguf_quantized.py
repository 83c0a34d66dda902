"""Quantized GGUF files written by llama.cpp's own `gguf` package (Q4_0, Q4_1, Q8_0 blocks, as
llama.cpp's quantizer lays them out) load back with the weights that package dequantizes them
to. The round trip in `test_gguf` writes F16 through MLX, and the real SmolLM2 file is Q4_1
only: without this, Q4_0 and Q8_0 were never read end to end."""

import json

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf.quants import dequantize, quantize
from mlx.utils import tree_flatten

from mlxkv import Runner
from mlxkv.models.gguf.convert import converted_dir
from mlxkv.models.loading import load_model
from tests.factories import tiny_model_dir
from tests.models.test_gguf import llama_cpp_metadata, llama_cpp_tensors

# llama.cpp's `llama_ftype` of a file whose 2-D weights are all of one type.
_FILE_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7}


def _value_type(value) -> tuple[object, gguf.GGUFValueType, gguf.GGUFValueType | None]:
    """A metadata value of `llama_cpp_metadata` as the gguf writer takes it."""
    if isinstance(value, str):
        return value, gguf.GGUFValueType.STRING, None
    if isinstance(value, list):
        return value, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING
    if value.ndim == 1:
        return value.tolist(), gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32
    if value.dtype == mx.uint32:
        return value.item(), gguf.GGUFValueType.UINT32, None
    return value.item(), gguf.GGUFValueType.FLOAT32, None


def _write_quantized(model_dir, path, kind: str) -> None:
    qtype = gguf.GGMLQuantizationType[kind]
    metadata = llama_cpp_metadata(model_dir, file_type=_FILE_TYPES[kind])
    writer = gguf.GGUFWriter(str(path), metadata.pop("general.architecture"))
    for key, value in metadata.items():
        value, vtype, sub_type = _value_type(value)
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    for key, w in llama_cpp_tensors(model_dir).items():
        w = np.array(w.astype(mx.float32))
        if w.ndim == 2:
            writer.add_tensor(key, quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(key, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("kind", sorted(_FILE_TYPES))
def test_quantized_file_loads_the_weights_gguf_dequantizes_to(
    kind, model_root, tmp_path, monkeypatch
):
    monkeypatch.setenv("MLXKV_CACHE_DIR", str(tmp_path / "cache"))
    source = tiny_model_dir("llama", model_root)
    path = tmp_path / f"tiny.{kind}.gguf"
    _write_quantized(source, path, kind)
    qtype = gguf.GGMLQuantizationType[kind]
    original = dict(tree_flatten(load_model(source).model.parameters()))
    converted = dict(tree_flatten(load_model(path).model.parameters()))
    assert converted.keys() == original.keys()
    for name, w in original.items():
        w = np.array(w.astype(mx.float32))
        # Row-wise blocks: llama.cpp's q/k row permutation commutes with them, so the HF-order
        # weight quantized directly is the reference.
        want = dequantize(quantize(w, qtype), qtype) if w.ndim == 2 else w
        got = np.array(converted[name].astype(mx.float32))
        # Stored as float16: one float16 rounding (2^-11 relative), either way of a tie.
        np.testing.assert_allclose(got, want, rtol=2**-10, atol=1e-7, err_msg=name)
        assert not np.allclose(want, w) or w.ndim == 1, f"{name} was not quantized"
    runner = Runner(load_model(path), max_context=256, warmup=False)
    assert runner.generate("Hello there", max_tokens=4).generation_tokens == 4


def test_a_conversion_made_by_an_older_format_is_converted_again(
    model_root, tmp_path, monkeypatch, caplog
):
    """Conversions are cached by the file's content: one made before a fix of the conversion
    (format 1 dequantized in float16) would otherwise be reused for good."""
    monkeypatch.setenv("MLXKV_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.Q8_0.gguf"
    _write_quantized(tiny_model_dir("llama", model_root), path, "Q8_0")
    manifest = converted_dir(path) / "mlxkv-conversion.json"
    recorded = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**recorded, "format": 1}))
    with caplog.at_level("INFO", logger="mlxkv"):
        assert converted_dir(path) == manifest.parent
    assert any("made by an older mlxkv" in r.getMessage() for r in caplog.records)
    assert json.loads(manifest.read_text()) == recorded
    caplog.clear()
    with caplog.at_level("INFO", logger="mlxkv"):
        converted_dir(path)
    assert any("reusing conversion" in r.getMessage() for r in caplog.records)
