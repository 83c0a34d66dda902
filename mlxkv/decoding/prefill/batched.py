"""Several requests' prompts fed in one batched forward pass, each into its own cache.

Why: on a CPU a short prompt's prefill is small matmuls and, for its last token, a one-row
pass that reads every weight. Seven 19-token prompts (after a shared 27-token prefix) took
1.45 s fed one after the other and 0.56 s together (SmolLM2 float32, this repository's 2-core
CPU). Prompts prefilled together also start decoding in the same batched step, so their
streams end together instead of leaving a tail of steps with fewer rows.

How, as mlx-lm's `BatchGenerator` prefills: the caches' K/V become left-padded rows
(`BatchedKV.merged`); every prompt but its last token is fed at once, right-padded to the
longest, and the padding rolled to the left (`BatchKVCache.finalize`); then the last tokens go
as one (B, 1) step for the logits. Each row is copied back into its cache with the tokens it
was fed. A cache changes only once the whole pass has succeeded, so a failure leaves every
one as it was.

Batched kernels round differently from one row's: K/V and logits agree with a prompt fed
alone to within float rounding (`tests/tolerances.py`), as batched decoding's do.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn

from mlxkv.cache.batched import BatchedKV, can_prefill_together
from mlxkv.cache.model_cache import ModelCache


def prefill_together(
    model: nn.Module, caches: Sequence[ModelCache], prompts: Sequence[Sequence[int]]
) -> list[mx.array]:
    """Feeds `prompts[i]` after what `caches[i]` holds, all rows in one batched pass.

    Returns:
        Each prompt's last-token logits, shape (1, vocab), evaluated.

    Raises:
        ValueError: a prompt is empty, or a cache cannot take part
            (`cache.batched.can_prefill_together`: float K/V layers only).
    """
    if len(caches) != len(prompts) or not all(prompts):
        raise ValueError("prefill_together takes one non-empty prompt per cache")
    if not all(can_prefill_together(cache) for cache in caches):
        raise ValueError("prefill_together takes caches of float KVCache layers only")
    batched = BatchedKV.merged(caches)
    lengths = [len(prompt) - 1 for prompt in prompts]  # fed before the last token
    width = max(lengths)
    if width > 0:
        padding = [width - length for length in lengths]
        inputs = mx.array(
            [[*prompt[:-1], *[0] * pad] for prompt, pad in zip(prompts, padding, strict=True)],
            dtype=mx.uint32,
        )  # (B, width)
        for layer in batched.layers:
            layer.prepare(right_padding=padding)
        model(inputs, cache=batched.layers)  # its logits are never evaluated: only the K/V
        for layer in batched.layers:
            layer.finalize()
    last = mx.array([[prompt[-1]] for prompt in prompts], dtype=mx.uint32)  # (B, 1)
    logits = model(last, cache=batched.layers)[:, -1, :]
    rows = batched.split([cache.layers for cache in caches])
    mx.eval(logits, [layer.state for layers in rows for layer in layers])
    for cache, layers, prompt in zip(caches, rows, prompts, strict=True):
        cache.adopt(layers, cache.tokens + list(prompt), cache.checkpoints)
    return [logits[row : row + 1] for row in range(len(prompts))]
