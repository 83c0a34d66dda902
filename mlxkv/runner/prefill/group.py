"""Interleaved requests that reach their prefill at the same moment are prefilled together.

Why: requests sent at once (an agent's parallel sub-agents, a chat page's title request
beside its answer, several users) each reach their prefill in a job of their own, one after
the other; short prompts fed in one batched pass cost a fraction of feeding them in turn
(`mlxkv.decoding.prefill.batched`), and start decoding in the same step.

Owns `PrefillGroup`: a request whose prompt (what its cache lacks) fits one chunk joins the
group when it reaches its prefill. While more requests are about to reach theirs (their first
jobs queued on the engine thread, or waiting for a shared prefix another request is feeding),
it pauses once; the last one to come, or the first to resume, feeds every member's prompt in
one pass, and each member takes its logits. Rows are padded to the longest (cached tokens
and prompt), so only members within twice each other's length (or `SLACK_TOKENS`) are fed
together: the largest such set; a member left out, or alone, feeds its prompt itself, as any
request does. A vision model's prompts with images join like text ones: the pass then runs
on `PromptRows`, each row its own embeddings and positions. Everything runs on the engine
thread. Does not own the batched pass (`prefill_together`) or the request's own prefill
(`prefill.fill`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from mlxkv.cache.batched import can_prefill_together
from mlxkv.cache.model_cache import ModelCache
from mlxkv.decoding.pause import PAUSE, Pause
from mlxkv.decoding.prefill.batched import Stops, prefill_together
from mlxkv.models.vision import ImagePrompt
from mlxkv.runner.prefill.image_rows import PromptRows

logger = logging.getLogger(__name__)

# Rows whose lengths (cached tokens and prompt) differ by this much are fed together even when
# one is over twice the other: short rows' padding costs next to nothing.
SLACK_TOKENS = 64


@dataclass(eq=False)
class _Member:
    cache: ModelCache
    prompt: Sequence[int]
    stops: Stops
    images: ImagePrompt | None  # the model bound to the prompt's images; None: text only
    logits: mx.array | None = None
    failure: BaseException | None = None
    settled: bool = False  # fed, failed, or left out by a feed: it feeds alone

    @property
    def row_tokens(self) -> int:
        """The row's length in the batch: what its cache holds and its prompt."""
        return self.cache.num_tokens + len(self.prompt)


class PrefillGroup:
    """The prompts about to be prefilled together (engine thread only).

    Args:
        model: the model every member runs on.
        max_prompt_tokens: prompts of this many tokens or more do not join (one prefill
            chunk: such a prompt is fed in chunks, taking turns with running requests).
        max_rows: the most members fed at once (the decode batch's rows).
        queued: True while requests' first jobs wait on the engine thread (they may join).
        padded_state_exact: the model's recurrent layers stop before a row's padding (the
            probe at load found it: `mlxkv.runner.assembly.probe_padded_state`), so caches
            with recurrent state are prefilled together too.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        max_prompt_tokens: int,
        max_rows: int,
        queued: Callable[[], bool],
        padded_state_exact: bool = False,
    ):
        self._model = model
        self._max_prompt_tokens = max_prompt_tokens
        self._max_rows = max_rows
        self._queued = queued
        self._padded_state_exact = padded_state_exact
        self._members: list[_Member] = []
        self._arriving = 0  # requests waiting for a shared prefix: they come next

    @contextlib.contextmanager
    def arriving(self) -> Iterator[None]:
        """Counts a request as about to reach its prefill while in this block (waiting for
        a prefix another request feeds), however the block ends."""
        self._arriving += 1
        try:
            yield
        finally:
            self._arriving -= 1

    def admits(self, cache: ModelCache, prompt: Sequence[int]) -> bool:
        """True when `prompt`, fed after what `cache` holds, may be fed with others: the one
        place that decides it, from the cache's layer kinds and, for recurrent state, the
        loaded model's probe (`can_prefill_together` says why)."""
        exact = self._padded_state_exact
        return 0 < len(prompt) < self._max_prompt_tokens and can_prefill_together(
            cache, padded_state_exact=exact
        )

    def prefill(
        self,
        cache: ModelCache,
        prompt: Sequence[int],
        stops: Stops | None = None,
        images: ImagePrompt | None = None,
    ) -> Generator[Pause, None, mx.array | None]:
        """Feeds `prompt` into `cache` with the others that come now, pausing (yielding
        `PAUSE`) at most once for them; returns its last-token logits, shape (1, vocab), or
        None when no other came (`cache` untouched: the caller feeds it alone). `stops`: where
        into `prompt` the layers that cannot trim back are snapshotted, as alone. `images`:
        a vision model's prompt with images, bound to them (its row's embeddings and
        positions are its own).

        Raises:
            whatever the batched pass raised (every member hears it; no cache changed).
        """
        member = _Member(cache, prompt, stops or Stops(), images)
        self._members.append(member)
        try:
            if len(self._members) < self._max_rows and (self._arriving or self._queued()):
                yield PAUSE
            if not member.settled and len(self._members) > 1:
                self._feed()
        finally:
            if member in self._members:  # closed while paused, or alone
                self._members.remove(member)
        if member.failure is not None:
            raise member.failure
        return member.logits

    def _feed(self) -> None:
        """Feeds the largest set of members of similar lengths in one pass, handing each its
        logits (or the error); the others, and a set of one, feed their own."""
        for member in self._members:
            member.settled = True
        members = _similar(self._members)
        self._members = []
        if len(members) < 2:
            return
        logger.debug("prefill group: rows=%d", len(members))
        try:
            logits = prefill_together(
                self._batch_model(members),
                [m.cache for m in members],
                [m.prompt for m in members],
                stops=[m.stops for m in members],
                padded_state_exact=self._padded_state_exact,
            )
        except BaseException as error:
            for m in members:
                m.failure = error
            return
        for m, row_logits in zip(members, logits, strict=True):
            m.logits = row_logits

    def _batch_model(self, members: list[_Member]) -> nn.Module:
        """The model the members' pass runs on: the loaded one, or, where a prompt has
        images, each row's own embeddings and positions (`PromptRows`)."""
        if all(m.images is None for m in members):
            return self._model
        return PromptRows(self._model, [m.images for m in members])


def _similar(members: list[_Member]) -> list[_Member]:
    """The largest set of `members` whose longest row is at most twice the shortest (or
    `SLACK_TOKENS` longer): rows padded to at most about twice what they hold."""
    ordered = sorted(members, key=lambda member: member.row_tokens)
    best, first = ordered[:1], 0
    for last, member in enumerate(ordered):
        while member.row_tokens > _longest_beside(ordered[first].row_tokens):
            first += 1
        if last + 1 - first > len(best):
            best = ordered[first : last + 1]
    return best


def _longest_beside(row_tokens: int) -> int:
    """The longest row fed together with a row of `row_tokens` tokens."""
    return max(2 * row_tokens, row_tokens + SLACK_TOKENS)
