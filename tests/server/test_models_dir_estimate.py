"""Review probe of merge 9e209a7 (expected weights bytes read from headers before loading):
`mlxkv serve --models-dir` reads every GGUF file's tensor table at start for its estimate. A
file that table cannot be read from (a download cut short, a file that only starts as GGUF)
must not keep the server from serving the other models, as the bytes on disk did not: it is
listed, its estimate unknown (0, as for a repo id), and it fails when it loads."""

from __future__ import annotations

from mlxkv.cli.parser import build_parser
from mlxkv.cli.serve import _model_sources
from mlxkv.testing.factory import build_model


def test_a_partial_gguf_in_the_models_dir_leaves_the_others_served(tmp_path):
    root = tmp_path / "models"
    root.mkdir()
    build_model("llama", root / "good")
    build_model("llama", root / "other")
    # a GGUF header (version 3, 1 tensor, 1 key) and a key whose string runs past the end
    header = b"GGUF" + (3).to_bytes(4, "little") + (1).to_bytes(8, "little")
    (root / "partial.gguf").write_bytes(
        header + (1).to_bytes(8, "little") + (9).to_bytes(8, "little") + b"gen"
    )
    argv = ["serve", "--models-dir", str(root), "--no-cache-dir", "--no-warmup"]
    sources = _model_sources(build_parser().parse_args(argv))
    assert sorted(sources) == ["good", "other", "partial"]
    assert sources["partial"].estimated_bytes >= 0
    assert sources["good"].estimated_bytes > 0


def test_a_model_folder_with_a_cut_safetensors_file_leaves_the_others_served(tmp_path):
    """A safetensors file shorter than its own header (a copy cut short): listed, its estimate
    unknown; the others served."""
    root = tmp_path / "models"
    root.mkdir()
    build_model("llama", root / "good")
    cut = build_model("llama", root / "cut")
    weights = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(weights[:20])
    argv = ["serve", "--models-dir", str(root), "--no-cache-dir", "--no-warmup"]
    sources = _model_sources(build_parser().parse_args(argv))
    assert sorted(sources) == ["cut", "good"]
    assert sources["good"].estimated_bytes > 0
