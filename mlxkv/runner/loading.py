"""Loading a model and its tokenizer from a local directory or a Hugging Face repo id.

Owns: `LoadedModel` and `load_model`. Delegates architectures, weights and tokenizers to mlx-lm;
adds clear errors that say what was tried and how to fix it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.nn as nn

from mlxkv.errors import ModelLoadError

logger = logging.getLogger(__name__)


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


def load_model(path_or_repo: str | Path) -> LoadedModel:
    """Loads a model directory in Hugging Face layout, or downloads a repo id first.

    Raises:
        ModelLoadError: the path does not exist and the repo could not be fetched (offline,
            unknown, or gated), or the files there are not a model mlx-lm can load.
    """
    from mlx_lm.utils import load

    path = _resolve(str(path_or_repo))
    try:
        model, tokenizer, config = load(str(path), return_config=True)
    except (ValueError, FileNotFoundError, KeyError, OSError) as error:
        raise ModelLoadError(f"could not load a model from {path}: {error}") from error
    logger.info("loaded model path=%s type=%s", path, config.get("model_type"))
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, path=path)


def _resolve(path_or_repo: str) -> Path:
    local = Path(path_or_repo).expanduser()
    if local.exists():
        return local
    if path_or_repo.startswith((".", "/", "~")) or path_or_repo.count("/") != 1:
        raise ModelLoadError(
            f"no model at {local}: the path does not exist and {path_or_repo!r} is not a "
            "Hugging Face repo id (owner/name)"
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
