"""Encoder embedding models (BERT, XLM-RoBERTa, ModernBERT: bge, gte, e5, nomic's kind),
through mlx-embeddings (the `embeddings` extra).

Owns `is_encoder_model` (a config mlx-lm has no decoder for and mlx-embeddings an encoder),
`load_encoder` and `EncoderModel`, which holds mlx-embeddings' model where a Runner expects a
decoder: it has no layers (no K/V: nothing to cache), and calling it as a decoder raises
`NotSupportedError`, so generation is refused by name while `Runner.embed` works. Its
`hidden_states` are the encoder's last hidden states with the padding masked (attention is
bidirectional here: a padded batch needs the mask that a causal decoder does not), pooled as
`embedding` says. Does not own pooling or batching (`embedding`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxkv.errors import ModelLoadError, ModelNotSupportedError

logger = logging.getLogger(__name__)

# mlx-embeddings' encoder architectures (its decoders, Qwen3 and Gemma 3, load through mlx-lm).
ENCODER_TYPES = ("bert", "xlm-roberta", "xlm_roberta", "modernbert")
INSTALL = "pip install 'mlxkv[embeddings]'"


def is_encoder_model(config: dict[str, Any]) -> bool:
    return config.get("model_type") in ENCODER_TYPES


class EncoderModel(nn.Module):
    """mlx-embeddings' model, seen by a Runner: no layers, no generation."""

    def __init__(self, encoder: nn.Module, name: str):
        super().__init__()
        self.encoder = encoder
        self.layers: list[nn.Module] = []  # nothing to cache
        self._name = name

    def __call__(self, inputs: mx.array, cache: Any = None, **_: Any) -> mx.array:
        raise self.cannot_generate()

    def cannot_generate(self) -> ModelNotSupportedError:
        return ModelNotSupportedError(
            self._name,
            "model '{model}' is an encoder embedding model: it gives embeddings "
            "(Runner.embed, /v1/embeddings, /api/embed), not text",
        )

    def hidden_states(self, tokens: mx.array, lengths: mx.array) -> mx.array:
        """(B, L) token ids padded on the right, their real lengths (B,) -> (B, L, D)."""
        mask = (mx.arange(tokens.shape[1])[None, :] < lengths[:, None]).astype(mx.int32)
        return self.encoder(tokens, attention_mask=mask).last_hidden_state


def load_encoder(path: Path, config: dict[str, Any]) -> tuple[EncoderModel, Any]:
    """The encoder at `path` and its tokenizer (mlx-embeddings' TokenizerWrapper).

    Raises:
        ModelLoadError: mlx-embeddings is not installed, or cannot load the model.
    """
    try:
        from mlx_embeddings.utils import load
    except ImportError as error:
        raise ModelLoadError(
            f"{path.name} is an encoder embedding model ({config.get('model_type')}); "
            f"serving one needs mlx-embeddings: {INSTALL}"
        ) from error
    try:
        model, tokenizer = load(str(path))
    except (ValueError, FileNotFoundError, KeyError, OSError) as error:
        raise ModelLoadError(f"could not load an encoder from {path}: {error}") from error
    model.set_dtype(mx.float32)
    logger.info("loaded encoder path=%s type=%s", path, config.get("model_type"))
    return EncoderModel(model, path.name), tokenizer
