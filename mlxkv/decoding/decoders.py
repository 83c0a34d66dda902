"""Which decoder a request's reply runs on, chosen once: plain (`plain.decode_tokens`),
speculative (`speculative.speculative_tokens`), in the decode batch with other requests
(`batch.batched_tokens`), or speculative while alone and in the batch while others decode.

Owns `decode_reply`. Does not own the token picker or what a speculative reply drafts with
(`speculative.Speculation`: the request path builds them), nor any decoder itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import mlx.core as mx
import mlx.nn as nn

from mlxkv.cache.model_cache import ModelCache
from mlxkv.decoding.batch import DecodeBatch, batched_tokens, joined_tokens
from mlxkv.decoding.pause import PAUSE, Pause
from mlxkv.decoding.picker import TokenPicker
from mlxkv.decoding.plain import decode_tokens
from mlxkv.decoding.speculative import Drafter, Speculation, speculative_tokens


def decode_reply(
    model: nn.Module,
    cache: ModelCache,
    logits: mx.array,
    pick: TokenPicker,
    max_tokens: int,
    *,
    make_room: Callable[[ModelCache, int], bool] | None,
    speculation: Speculation | None,
    batch: DecodeBatch | None,
    crowded: Callable[[], bool] | None,
    position_shift: int = 0,
) -> Iterator[int | Pause]:
    """Up to `max_tokens` token ids after the prompt's last `logits`, from the one decoder the
    request's settings choose: in `batch` from the start when it does not speculate or others
    decode there already (`crowded()`), plainly or speculatively when it has no batch, else
    speculatively while alone and in the batch while others decode.

    Args:
        make_room: called when the window is full (a context shift, or a reply with images
            cut at message boundaries), or None: stop there; where it returns False (no room
            made) the reply ends, plain or speculative.
        speculation: how to draft, or None for no speculation.
        batch: the decode batch the request may join, or None: alone.
        crowded: True while another request that can batch is decoding (with `batch`).
        position_shift: the request's row's lead of positions on its cache offset in `batch`
            (`DecodeBatch.join`: a vision model's prompt with images).
    """
    if batch is not None and (speculation is None or crowded()):
        return batched_tokens(batch, cache, logits, pick, max_tokens, position_shift)
    if speculation is None:
        return decode_tokens(model, cache, logits, pick, max_tokens, make_room)

    def speculate(after: int | None, total: int) -> Iterator[int]:
        return speculative_tokens(
            model,
            cache,
            logits,
            pick,
            total,
            speculation=speculation,
            make_room=make_room,
            hand_over=crowded if batch is not None else None,
            after=after,
        )

    if batch is None:
        return speculate(None, max_tokens)
    return _alone_or_batched(
        speculate, speculation.drafter, batch, crowded, cache, pick, max_tokens, position_shift
    )


def _alone_or_batched(
    speculate: Callable[[int | None, int], Iterator[int]],
    drafter: Drafter,
    batch: DecodeBatch,
    crowded: Callable[[], bool],
    cache: ModelCache,
    pick: TokenPicker,
    total: int,
    position_shift: int,
) -> Iterator[int | Pause]:
    """`total` tokens: speculatively while the request decodes alone (ended early when others
    come), in the batch while others decode (left when they are gone), and so on. Each part
    goes on from the last token of the one before, yielded and not fed."""
    produced, last = 0, None
    alone = speculate(None, total)
    while True:
        try:
            for last in alone:
                produced += 1
                yield last
        finally:
            alone.close()
        if last is None or produced >= total:
            return
        joined = joined_tokens(
            batch,
            cache,
            mx.array([last], dtype=mx.uint32),
            pick,
            total - produced,
            leave_when=lambda: not crowded(),
            position_shift=position_shift,
        )
        try:
            while True:
                try:
                    token = next(joined)
                except StopIteration as end:
                    queued = end.value
                    break
                if token is PAUSE:  # the batch waits (`DecodeBatch.waits`): passed on
                    yield PAUSE
                    continue
                last = token
                produced += 1
                drafter.extend([last])
                yield last
        finally:
            joined.close()
        for read, last in enumerate(queued, start=1):  # picked in the batch, not read yet
            produced += 1
            drafter.extend([last])
            try:
                yield last
            except GeneratorExit:  # all but the newest were fed: give back those not read
                _give_back(cache, len(queued) - 1 - read)
                raise
        if produced >= total:
            return
        alone = speculate(last, total - produced)


def _give_back(cache: ModelCache, unread_fed: int) -> None:
    """The cache without the `unread_fed` tokens fed ahead of a reader that stopped, where its
    layers trim (as `DecodeBatch.leave` does); layers that cannot (recurrent state, a full
    window) keep them."""
    target = cache.num_tokens - unread_fed
    if unread_fed > 0 and cache.can_trim_to(target):
        cache.trim_to(target)
