"""Which layers' RoPE mlxkv can undo and redo exactly, for shifting a full context in place.

Owns `rope_rotations`: per model layer, a function re-rotating cached keys by a position
delta, or None. A RoPE whose angle is linear in the position (plain RoPE, traditional or not,
linear scaling, Llama 3 frequency scaling) composes: a key rotated for position p and then by
-d equals one rotated for p - d. Others (YaRN, LongRoPE, none) are not claimed. The runner's
context shift (`mlxkv.runner.context`) and `mlxkv info` both read it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import Llama3RoPE

from mlxkv.cache.layers.kv import Rotation


def rope_rotations(model: nn.Module) -> list[Rotation | None]:
    """Per layer, a function re-rotating cached keys by a position delta, or None where the
    layer has no RoPE that mlxkv can shift exactly."""
    return [_rotation(_rope_of(layer)) for layer in model.layers]


def _rope_of(layer: Any) -> Any:
    attention = getattr(layer, "self_attn", None) or getattr(layer, "attention", None)
    if hasattr(attention, "kv_lora_rank"):
        # Latent attention (MLA) caches the compressed latent as "keys" and the rotated key
        # part as "values": turning the keys would corrupt the cache.
        return None
    return getattr(attention, "rope", None)


def _rotation(rope: Any) -> Rotation | None:
    # Only RoPEs that rotate and nothing else: YaRN's, for one, also scales what it turns.
    if type(rope) not in (nn.RoPE, Llama3RoPE):
        return None

    def rotate(keys: mx.array, delta: int) -> mx.array:
        # One position per token: the sequence axis becomes a batch axis of length-1 sequences.
        return rope(keys[..., None, :], offset=delta).squeeze(-2)  # (B, H, L, 1, D) turned

    return rotate
