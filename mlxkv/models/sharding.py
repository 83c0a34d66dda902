"""One model over several processes (`mlx.launch`): the process group and the model's shards.

Owns `world` (the process group, when there is one) and `shard_model`, which shards a lazily
loaded model with mlx-lm's own `shard` (tensor parallel) or `model.pipeline` (pipeline
parallel). Does not own keeping the ranks' caches in step (`mlxkv.runner.scheduling.lockstep`).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxkv.errors import NotSupportedError


def world() -> mx.distributed.Group | None:
    """The process group when this process was started by `mlx.launch` with more than one
    process; None otherwise."""
    if not mx.distributed.is_available():
        return None
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def shard_model(
    model: nn.Module, group: mx.distributed.Group, model_type: str, config: dict | None = None
) -> str:
    """Shards a (lazily loaded) model over `group` in place, as mlx-lm's `sharded_load` does:
    tensor parallel where the architecture has `shard`, else pipeline where its inner model
    has `pipeline`.

    Returns:
        "tensor parallel" or "pipeline".

    Raises:
        NotSupportedError: the architecture supports neither, or tensor parallelism would split
            its attention or KV heads unevenly (`config`: the model's config.json) and it has
            no pipeline either.
    """
    uneven = _uneven_heads(config or {}, group.size())
    if hasattr(model, "shard") and not uneven:
        model.shard(group)
        return "tensor parallel"
    if hasattr(getattr(model, "model", None), "pipeline"):
        model.model.pipeline(group)
        return "pipeline"
    if uneven:
        raise NotSupportedError(
            f"this {model_type!r} model cannot be sharded over {group.size()} processes: its "
            f"{uneven} cannot be split evenly; use a number of processes that divides it, or "
            "run it in one process"
        )
    raise NotSupportedError(
        f"{model_type!r} models cannot be sharded: mlx-lm's implementation has neither "
        "shard() (tensor parallel) nor model.pipeline(); run it in one process"
    )


def _uneven_heads(config: dict, ranks: int) -> str | None:
    """What tensor parallelism over `ranks` would split unevenly ("3 KV heads"), or None."""
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads", heads)
    for count, what in ((kv_heads, "KV heads"), (heads, "attention heads")):
        if isinstance(count, int) and count % ranks:
            return f"{count} {what}"
    return None
