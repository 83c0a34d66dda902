"""Which model wrote a disk-tier file: a fingerprint of a model's config, weights, tokenizer
and chat template.

Owns `model_fingerprint`.
"""

from __future__ import annotations

import hashlib
import json

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlxkv.models.loading import LoadedModel


def model_fingerprint(loaded: LoadedModel) -> str:
    """A hash of the model's config and weights (every tensor's name, shape, dtype and a sample
    of its values: first, middle and last elements), its tokenizer's vocabulary and its chat
    template, so another checkpoint or fine-tune of the same architecture, or the same weights
    with another tokenizer or template, gets another fingerprint without reading every
    weight: a changed model never restores old K/V."""
    digest = hashlib.sha256(json.dumps(loaded.config, sort_keys=True, default=str).encode())
    digest.update(_tokenizer_bytes(loaded.tokenizer))
    for name, weight in tree_flatten(loaded.model.parameters()):
        flat = weight.reshape(-1)
        n = flat.size
        sample = mx.concatenate([flat[:8], flat[n // 2 : n // 2 + 8], flat[-8:]])
        values = np.asarray(sample.astype(mx.float32) if sample.dtype == mx.bfloat16 else sample)
        digest.update(f"{name}|{weight.shape}|{weight.dtype}|".encode() + values.tobytes())
    return digest.hexdigest()


def _tokenizer_bytes(tokenizer) -> bytes:
    """The tokenizer's vocabulary (token -> id) and chat template, as bytes."""
    vocab = getattr(tokenizer, "vocab", None) or {}
    template = getattr(tokenizer, "chat_template", None) or ""
    return json.dumps([sorted(vocab.items()), template], default=str).encode()
