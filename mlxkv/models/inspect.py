"""What a loaded model's cache looks like: layer kinds, what the cache can do with them (trim,
restore from checkpoints, shift), and KV bytes per token.

Owns: `describe`, measured on a real one-token forward pass through a fresh cache, so the bytes
are what mlxkv allocates, not a formula, and the abilities are what the runner will decide.
"""

from __future__ import annotations

from typing import Any

import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxkv.cache import ModelCache, make_cache
from mlxkv.cache.layer_ops import is_unwritten, layer_kind, leaves, trim_reach
from mlxkv.config import format_bytes
from mlxkv.models.capabilities import model_capabilities
from mlxkv.models.loading import LoadedModel
from mlxkv.models.rope import rope_rotations
from mlxkv.models.vision import MAX_IMAGES_PER_PROMPT


def describe(loaded: LoadedModel) -> dict[str, str]:
    """Facts about a model for `mlxkv info`, as display strings keyed by name. The layer kinds
    and what the cache can do with them are read from a real cache through the functions the
    runner decides with (`layer_ops.trim_reach` as `layer_can_trim` walks it,
    `ModelCache.needs_checkpoints`, `ModelCache.can_shift` with `rope.rope_rotations`)."""
    model = loaded.model
    cache = make_cache(model)
    if not loaded.is_encoder:  # an encoder has no K/V to measure (and no decoder forward)
        cache.forward(model, [0])
    kv = [layer for layer in leaves(cache.layers) if trim_reach(layer) != "none"]
    per_token = sum(layer.used_bytes for layer in kv)
    state_bytes = sum(layer.nbytes for layer in leaves(cache.layers) if layer not in kv)
    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    capabilities = model_capabilities(
        loaded.tokenizer, generates=not loaded.is_encoder, vision=loaded.vision is not None
    )
    windowed = any(trim_reach(layer) == "window" for layer in cache.layers)
    return {
        "path": str(loaded.path),
        "architecture": str(loaded.config.get("model_type")),
        "parameters": f"{params / 1e6:.1f}M",
        "layers": str(len(model.layers)),
        "cache layers": _layer_kinds(model, cache),
        "cache can": _abilities(model, cache),
        "kv bytes per token": f"{per_token:,} ({format_bytes(per_token)})"
        + (" while under the window" if windowed else ""),
        "recurrent state": format_bytes(state_bytes) if state_bytes else "none",
        "max context": (
            f"{loaded.max_position_embeddings} tokens"
            if loaded.max_position_embeddings
            else "unknown"
        ),
        "images": _images(loaded),
        "capabilities": ", ".join(capabilities.names()),
        "tool-call format": capabilities.tool_call_format or "none known (calls come back as text)",
    }


def _layer_kinds(model: nn.Module, cache: ModelCache) -> str:
    """The cache's layers grouped by what they keep, with their indices in the cache (MLA
    layers and layers the model never writes say so), then how many model layers have no
    cache of their own (they read another layer's K/V, or have no attention)."""
    latent = len(cache.layers) == len(model.layers) and all(map(_is_latent, model.layers))
    kinds: dict[str, list[int]] = {}
    for i, layer in enumerate(cache.layers):
        kind = "unused (never written)" if is_unwritten(layer) else layer_kind(layer)
        kinds.setdefault(kind + (", latent (MLA)" if latent else ""), []).append(i)
    described = "; ".join(f"{kind}: {_indices(indices)}" for kind, indices in kinds.items())
    cacheless = len(model.layers) - len(cache.layers)
    if cacheless > 0:
        described += f"; {cacheless} more without a cache (KV-shared, or no attention)"
    return described


def _is_latent(layer: Any) -> bool:
    attention = getattr(layer, "self_attn", None) or getattr(layer, "attention", None)
    return hasattr(attention, "kv_lora_rank")


def _abilities(model: nn.Module, cache: ModelCache) -> str:
    reaches = {trim_reach(layer) for layer in cache.layers}
    if reaches == {"any"}:
        trim = "trim any number of tokens"
    elif "none" in reaches:
        trim = "no trim (recurrent or other state that cannot go back)"
    else:
        trim = "trim only within the window or chunk"
    restore = "; restore checkpoints further back" if cache.needs_checkpoints else ""
    shift = cache.can_shift(rope_rotations(model))
    return trim + restore + ("; shift in place when full" if shift else "; no shift (refills)")


def _images(loaded: LoadedModel) -> str:
    if loaded.vision is None:
        return "no (text only)"
    return f"yes (vision encoder through mlx-vlm; at most {MAX_IMAGES_PER_PROMPT} per prompt)"


def _indices(indices: list[int]) -> str:
    if not indices:
        return "none"
    shown = ", ".join(map(str, indices[:12])) + (", ..." if len(indices) > 12 else "")
    return f"{len(indices)} ({shown})"
