"""Plain decoding: the pipelined token loop on a ModelCache.

Owns `decode_tokens`. Does not own sampling (`picker`), drafts (`speculative`) or turning
tokens into text (`mlxkv.runner.text.chunks`).

The loop keeps the device busy the way mlx-lm's does: step n+1 is queued with
`mx.async_eval` before token n is read back into Python, so the host never waits on the device
for bookkeeping. Everything runs on MLX's default stream, not mlx-lm's thread-local
`generation_stream`: the cache outlives a request and may be continued from another thread,
and arrays built on one thread's local stream cannot be evaluated on another.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import mlx.core as mx
import mlx.nn as nn

from mlxkv.cache.model_cache import ModelCache
from mlxkv.decoding.picker import TokenPicker

# MLX keeps freed buffers for reuse; returning them every so often bounds that pool, as mlx-lm
# does (https://github.com/ml-explore/mlx-lm/blob/main/mlx_lm/generate.py, generate_step).
_CLEAR_CACHE_EVERY_TOKENS = 256


def decode_tokens(
    model: nn.Module,
    cache: ModelCache,
    logits: mx.array,
    pick: TokenPicker,
    max_tokens: int,
    make_room: Callable[[ModelCache, int], bool] | None = None,
    stop_early: Callable[[], bool] | None = None,
) -> Iterator[int]:
    """Yields up to `max_tokens` sampled token ids, starting from the prompt's last logits.

    Pipelined: every yielded token except the first and the last has already been fed to the
    model (its step is queued before it is yielded). The first is yielded as soon as it exists,
    then fed. Either way `cache` records exactly what was fed, so the caller may stop early by
    closing the generator.

    Args:
        make_room: called as make_room(cache, 1) before each token is fed (context shift);
            False when no room can be made: that token is the last, yielded and not fed.
        stop_early: asked after each yielded token; True ends the loop as soon as the
            pipeline allows without waste: after the token whose step is already queued (one
            more), or at once after the first. The last token yielded is then not fed.
    """
    if max_tokens <= 0:
        return
    token = pick(logits)
    mx.async_eval(token)
    n = 0
    while n < max_tokens:
        if n == 0:
            # Out before anything else is queued: on MLX's CPU backend, queuing a step before
            # reading the first token added a whole decode step to the time to first token.
            yield token.item()
            if stop_early and stop_early():
                max_tokens = 1
        if n + 1 < max_tokens and make_room and not make_room(cache, 1):
            max_tokens = n + 1
        if n + 1 < max_tokens:
            next_token = pick(cache.forward(model, token)[:, -1, :])
            mx.async_eval(next_token)
        if n > 0:
            yield token.item()
            if stop_early and stop_early():
                max_tokens = min(max_tokens, n + 2)
        if n % _CLEAR_CACHE_EVERY_TOKENS == _CLEAR_CACHE_EVERY_TOKENS - 1:
            mx.clear_cache()
        if n + 1 < max_tokens:
            token = next_token
        n += 1
