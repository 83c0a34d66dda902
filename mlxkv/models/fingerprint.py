"""Which model wrote a disk-tier file: a fingerprint of a model's config and weights.

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
    """A hash of the model's config and weights: every tensor's name, shape, dtype and a sample
    of its values (first, middle and last elements), so another checkpoint or fine-tune of the
    same architecture gets another fingerprint without reading every weight."""
    digest = hashlib.sha256(json.dumps(loaded.config, sort_keys=True, default=str).encode())
    for name, weight in tree_flatten(loaded.model.parameters()):
        flat = weight.reshape(-1)
        n = flat.size
        sample = mx.concatenate([flat[:8], flat[n // 2 : n // 2 + 8], flat[-8:]])
        values = np.asarray(sample.astype(mx.float32) if sample.dtype == mx.bfloat16 else sample)
        digest.update(f"{name}|{weight.shape}|{weight.dtype}|".encode() + values.tobytes())
    return digest.hexdigest()
