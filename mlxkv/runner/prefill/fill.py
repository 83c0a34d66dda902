"""Feeding a request's uncached prompt tokens, with checkpoints where messages end.

Owns `fill_prompt`: prefill in chunks (a pause between chunks, where requests interleaved with
this one run), progress and cancel between chunks, the usage reported once the match is final
(`Request.matched`), and checkpoints of the layers that cannot
trim (recurrent, sliding window) where the pool asks for them (`PrefixHit.checkpoints`), and
a chunk's end at each of their snapshots for the disk tier (`PrefixHit.disk_snapshots`, which
the cache takes as it reaches them, `ModelCache.snapshot_every_tokens`). Does
not own where those go (the pool, which goes back to them) or the chunked model calls
(`mlxkv.decoding.prefill.chunks`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import TypeVar

import mlx.core as mx
import mlx.nn as nn

from mlxkv.cache.model_cache import ModelCache
from mlxkv.decoding.pause import PAUSE, Pause
from mlxkv.decoding.prefill.batched import Stops
from mlxkv.decoding.prefill.chunks import PrefillPlan, fill_steps, prefill_steps
from mlxkv.decoding.prefill.scoring import PromptScorer
from mlxkv.models.vision import ImagePrompt
from mlxkv.runner.prefill.group import PrefillGroup
from mlxkv.runner.prompt_cache.pool import PrefixHit
from mlxkv.runner.request import Request
from mlxkv.runner.results import CompletionStats

T = TypeVar("T")


class PrefillCancelled(Exception):
    """Raised between prefill chunks when the request was cancelled; the chunks already fed
    stay in the cache."""


def fill_prompt(
    model: nn.Module,
    request: Request,
    hit: PrefixHit,
    stats: CompletionStats,
    *,
    plan: PrefillPlan,
    together: PrefillGroup | None = None,
    scorer: PromptScorer | None = None,
) -> Generator[Pause, None, mx.array]:
    """Feeds `hit.remaining` into `hit.entry.cache` and returns the last position's logits;
    yields `PAUSE` between chunks, or while prompts to prefill together come (`yield from` it
    in a request's generator).

    Args:
        plan: how the tokens are fed (chunk size, CPU lanes).
        together: the group a short prompt (on a cache whose layers it admits) is fed with,
            its checkpoints and disk snapshots taken as alone, when other requests reach
            their prefill at the same moment (None: alone).
        scorer: scores every position fed (the prompt's own log-probabilities).

    Calls `request.matched` once the match is final (`_match_reporter`).

    Raises:
        PrefillCancelled: the request's cancel flag was set; the chunks fed stay cached.
    """
    cache, remaining = hit.entry.cache, hit.remaining
    total, offset = len(remaining), 0
    report_match = _match_reporter(request, stats, cache)

    def fed(done: int) -> None:
        stats.processed = done
        report_match()
        if request.progress:
            request.progress(done, total)
        if request.cancelled.is_set():
            raise PrefillCancelled

    if together is not None and together.admits(cache, remaining):
        stops = Stops(hit.checkpoints, hit.disk_snapshots)
        images = model if isinstance(model, ImagePrompt) else None
        logits = yield from together.prefill(cache, remaining, stops, images)
        if logits is not None:  # fed with others; else no other came
            fed(total)
            return logits
    # No pause after the prompt's last chunk: its last token's logits (the first generated
    # token) come in the same turn, or a short prompt would wait a round for them.
    last_pause = total - 1
    for split in sorted({*hit.checkpoints, *hit.disk_snapshots}):
        steps = fill_steps(model, cache, remaining[: split - offset], plan, scorer)
        yield from _paced(steps, fed, offset, min(split, last_pause))
        if split in hit.checkpoints:  # a disk snapshot the cache took here is shared
            cache.checkpoint()
        if split < last_pause:  # the chunk's pause, after its checkpoint: a request waiting
            yield PAUSE  # for this prefix (`_await_shared_prefix`) may copy it from there
        offset, remaining = split, remaining[split - offset :]
    steps = prefill_steps(model, cache, remaining, plan, scorer)
    logits = yield from _paced(steps, fed, offset, last_pause)
    fed(total)
    return logits


def _match_reporter(
    request: Request, stats: CompletionStats, cache: ModelCache
) -> Callable[[], None]:
    """Hands `request.matched` the prompt's usage once the match is final, never again: at
    once, or, on a streamed disk restore (`ModelCache.gate`), when the returned call first
    runs after a chunk, its forward having passed every layer's check (one that fails raises
    `RestoreBroken` before, and the caller loads what the disk holds again and feeds anew).
    So Anthropic's `message_start` never counts tokens the reply's usage then lacks. It is
    called inside the entry's claim: one that raises fails the request."""
    left = [] if request.matched is None else [request.matched]

    def report() -> None:
        while left:
            left.pop()(stats.usage())

    if cache.gate is None:
        report()
    return report


def _paced(
    steps: Generator[int, None, T], fed: Callable[[int], None], offset: int, pause_before: int
) -> Generator[Pause, None, T]:
    """Runs `steps` (a prefill generator yielding the tokens it has fed), telling `fed` the
    tokens fed in all (`offset` before it) and pausing (yielding `PAUSE`) after each chunk that
    ends before `pause_before` tokens; returns what `steps` returns."""
    while True:
        try:
            done = next(steps)
        except StopIteration as end:
            return end.value
        fed(offset + done)
        if offset + done < pause_before:
            yield PAUSE
