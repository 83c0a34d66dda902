"""What a loaded model's cache looks like: layer kinds and KV bytes per token.

Owns: `describe`, measured on a real one-token forward pass through a fresh cache, so the bytes
are what mlxkv allocates, not a formula.
"""

from __future__ import annotations

from mlx.utils import tree_flatten

from mlxkv.cache import KVCache, QuantizedKVCache, SlidingWindowCache, make_cache
from mlxkv.config import format_bytes
from mlxkv.models.capabilities import model_capabilities
from mlxkv.models.loading import LoadedModel
from mlxkv.models.vision import MAX_IMAGES_PER_PROMPT


def describe(loaded: LoadedModel) -> dict[str, str]:
    """Facts about a model for `mlxkv info`, as display strings keyed by name."""
    cache = make_cache(loaded.model)
    if not loaded.is_encoder:  # an encoder has no K/V to measure (and no decoder forward)
        cache.forward(loaded.model, [0])
    kinds: dict[str, list[int]] = {"global": [], "sliding": [], "recurrent": []}
    per_token = 0
    windows = set()
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, KVCache | QuantizedKVCache):
            kinds["global"].append(i)
            per_token += layer.used_bytes
        elif isinstance(layer, SlidingWindowCache):
            kinds["sliding"].append(i)
            windows.add(layer.window)
            per_token += layer.used_bytes
        else:
            kinds["recurrent"].append(i)
    recurrent_bytes = sum(cache[i].nbytes for i in kinds["recurrent"])
    params = sum(v.size for _, v in tree_flatten(loaded.model.parameters()))
    capabilities = model_capabilities(loaded.tokenizer, generates=not loaded.is_encoder)
    return {
        "path": str(loaded.path),
        "architecture": str(loaded.config.get("model_type")),
        "parameters": f"{params / 1e6:.1f}M",
        "layers": str(len(cache.layers)),
        "global attention layers": _indices(kinds["global"]),
        "sliding-window layers": _indices(kinds["sliding"])
        + (f" (window {', '.join(map(str, sorted(windows)))} tokens)" if windows else ""),
        "recurrent layers": _indices(kinds["recurrent"])
        + (f" ({format_bytes(recurrent_bytes)} of state)" if kinds["recurrent"] else ""),
        "kv bytes per token": f"{per_token:,} ({format_bytes(per_token)})"
        + (" while under the window" if windows else ""),
        "max context": f"{loaded.max_position_embeddings or 'unknown'} tokens",
        "images": _images(loaded),
        "capabilities": ", ".join(capabilities.names()),
        "tool-call format": capabilities.tool_call_format or "none known (calls come back as text)",
    }


def _images(loaded: LoadedModel) -> str:
    if loaded.vision is None:
        return "no (text only)"
    return f"yes (vision encoder through mlx-vlm; at most {MAX_IMAGES_PER_PROMPT} per prompt)"


def _indices(indices: list[int]) -> str:
    if not indices:
        return "none"
    shown = ", ".join(map(str, indices[:12])) + (", ..." if len(indices) > 12 else "")
    return f"{len(indices)} ({shown})"
