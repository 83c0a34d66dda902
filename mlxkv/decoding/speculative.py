"""Speculative decoding: drafted tokens verified by the model in one forward pass, rejected ones
rolled back with an O(1) trim.

Owns: the decode loop that drafts, verifies and yields (`speculative_tokens`), how many tokens
to draft (`DraftLength`: the adaptive length, and for "auto" the gate that stops drafting while
drafts do not pay), and the acceptance rule. Does not own the modes a request may ask for
(`mlxkv.config.SPECULATIVE_MODES`, checked by `mlxkv.config.check_speculative`), where drafts
come from (`drafts`) or the plain loop it falls back to between drafts (`plain.decode_tokens`).

The acceptance rule (speculative sampling: Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding"; Chen et al. 2023): at a drafted position the model's
distribution is p (logits processors, then top-p / min-p / top-k and temperature: exactly what
the plain sampler draws from) and the drafter's is q. The drafted token d is accepted with
probability min(1, p(d) / q(d)); at the first rejection the token is drawn instead from
max(p - q, 0), normalized, and verification stops; if every draft is accepted, one more token
is drawn from p at the position after them. Each emitted token is then distributed exactly as
p. Deterministic drafts (n-gram lookup, a greedy draft model) have q = 1 at d: d is accepted
with probability p(d), and a rejection draws from p without d. Greedy decoding (temperature
0) has p = 1 at the argmax: a draft is accepted exactly when it is the argmax, so the output is
plain greedy decoding's, token for token.

Cache state: after each verification the cache holds the text up to the last accepted draft
(the token drawn after it is fed with the next pass), so a caller that stops reading at any
token (a stop string inside an accepted draft, max_tokens, cancel) leaves a cache whose token
ids and K/V agree, and the next request reuses them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from mlxkv.cache.model_cache import ModelCache
from mlxkv.decoding.drafts import Draft, DraftCounts, ModelDrafter, NgramDrafter
from mlxkv.decoding.picker import TokenPicker
from mlxkv.decoding.plain import decode_tokens

Drafter = NgramDrafter | ModelDrafter
Distribution = Callable[[mx.array], mx.array]


class DraftLength:
    """How many tokens to draft next, and how long to decode plainly in between.

    The length doubles (up to `MAX_TOKENS`) while whole drafts are accepted and falls to one
    more than the accepted count after a rejection. Gated (the "auto" mode), it
    also stops drafting for `PAUSE_TOKENS` generated tokens after `MISSES_TO_PAUSE`
    verifications in a row that accepted nothing: a pass of k drafts costs about 1 + 0.11 k
    decode steps on this CPU (7 tokens: 1.65x one), so isolated misses (an edit inside copied
    text) cost little, while a run of them (free text) is a drafter that does not pay.
    """

    START_TOKENS = 4
    MAX_TOKENS = 16
    MISSES_TO_PAUSE = 3
    PAUSE_TOKENS = 16

    def __init__(self, *, gated: bool):
        self._gated = gated
        self._length = self.START_TOKENS
        self._misses = 0
        self.paused_tokens = 0  # generated tokens left before drafting again

    def next(self) -> int:
        """Tokens to draft now (0 while paused)."""
        return 0 if self.paused_tokens else self._length

    def generated(self, num_tokens: int) -> None:
        """Counts tokens generated without drafts against the pause."""
        self.paused_tokens = max(0, self.paused_tokens - num_tokens)

    def verified(self, drafted: int, accepted: int) -> None:
        """Takes the outcome of one verification."""
        if accepted == drafted:
            self._length = min(self.MAX_TOKENS, 2 * self._length)
        else:
            self._length = max(1, accepted + 1)
        self._misses = self._misses + 1 if accepted == 0 else 0
        if self._gated and self._misses >= self.MISSES_TO_PAUSE:
            self.paused_tokens, self._misses = self.PAUSE_TOKENS, 0


class AcceptanceRule:
    """The rule in the module docstring, for one request's sampling settings.

    Args:
        distribution: logprobs (1, vocab) -> p (1, vocab); None for greedy decoding.
    """

    def __init__(self, distribution: Distribution | None):
        self._distribution = distribution

    def check(self, logprobs: mx.array, token: int, q: mx.array | None) -> mx.array | None:
        """None when `token` is accepted, else the token (shape (1,)) emitted in its place."""
        if self._distribution is None:
            best = mx.argmax(logprobs, axis=-1)
            return None if best.item() == token else best
        p = self._distribution(logprobs)[0]
        q = _one_hot(token, p.shape[-1]) if q is None else q[0]
        if mx.random.uniform().item() * q[token].item() < p[token].item():
            return None
        residual = mx.maximum(p - q, 0.0)
        return mx.random.categorical(mx.log(residual)).reshape(1)


@dataclass(frozen=True, kw_only=True)
class Speculation:
    """What a reply decoded speculatively drafts with.

    Attributes:
        drafter: proposes tokens (n-gram or draft model).
        length: how many tokens to draft each time (grown and shrunk by acceptance).
        distribution: turns logits into the sampling distribution (None: greedy).
        counts: drafted and accepted tokens, counted for the Completion.
    """

    drafter: Drafter
    length: DraftLength
    distribution: Distribution | None
    counts: DraftCounts


def speculative_tokens(
    model: nn.Module,
    cache: ModelCache,
    logits: mx.array,
    pick: TokenPicker,
    max_tokens: int,
    *,
    speculation: Speculation,
    make_room: Callable[[ModelCache, int], bool] | None = None,
    hand_over: Callable[[], bool] | None = None,
    after: int | None = None,
) -> Iterator[int]:
    """Yields up to `max_tokens` token ids from the prompt's last logits, like
    `decode_tokens`, verifying drafts where `speculation.length` asks for some and its drafter
    has them (by `AcceptanceRule(speculation.distribution)`), and decoding plainly (pipelined)
    in between, until the drafter has a draft again. Counts drafted and accepted tokens in
    `speculation.counts`. Drafts
    stop at the window (`_in_window`): plain steps make room (`make_room(cache, 1)`) where
    plain decoding does; where none can be made (False) the reply ends, as there.
    `hand_over` is asked before each pass and after each token of a plain stretch; True ends
    the iterator as soon as the cache allows, its last token yielded but not fed: the caller
    goes on from it elsewhere (in a batch). `after`, in place of `logits`, is such a token
    from elsewhere (known to `pick` and the drafter): it goes on from it, `max_tokens` more."""
    if max_tokens <= 0:
        return
    drafter, length, counts = speculation.drafter, speculation.length, speculation.counts
    rule = AcceptanceRule(speculation.distribution)
    if after is None:
        token = int(pick(logits).item())
        yield token
        drafter.extend([token])
        produced = 1
    else:
        token, produced = after, 0
    most = max(1, (cache.capacity_tokens or max_tokens) // 8)  # a pass must fit the window
    while produced < max_tokens:
        if hand_over and hand_over():
            return
        room = max_tokens - produced
        wanted = min(length.next(), room - 1, most, _to_snapshot(cache))
        draft = _in_window(drafter.propose(wanted) if wanted > 0 else Draft([]), cache)
        if draft.tokens:
            new = _verify(model, cache, token, draft, pick, rule, make_room)
            counts.drafted += len(draft.tokens)
            counts.accepted += len(new) - 1
            length.verified(len(draft.tokens), len(new) - 1)
        else:
            new = _plain_stretch(
                model, cache, token, pick, room, length, drafter, make_room, hand_over
            )
        before = produced
        for token in new:
            drafter.extend([token])
            produced += 1
            yield token
        if produced == before:  # no room made for even one token: the reply ends here
            return
        if not draft.tokens:  # counted once a stretch: `length` is read before the next
            length.generated(produced - before)


def _in_window(draft: Draft, cache: ModelCache) -> Draft:
    """`draft` cut to what one pass (the token and the drafts) feeds without going past the
    cache's window (`capacity_tokens`; none: no cut), so that room is made where plain
    decoding makes it: a shift, or a reply with images cut at message boundaries, which is
    plain decoding's reply only when cut at the same token. A drafter's extra tokens are as
    if rejected (a draft model catches up from its text)."""
    if not draft.tokens or cache.capacity_tokens is None:
        return draft
    most = max(0, cache.capacity_tokens - cache.num_tokens - 1)
    if len(draft.tokens) <= most:
        return draft
    kept = None if draft.probabilities is None else draft.probabilities[:most]
    return Draft(draft.tokens[:most], kept)


def _to_snapshot(cache: ModelCache) -> int:
    """The most drafts a pass may verify so that it ends at or before the cache's next disk
    snapshot (`ModelCache.snapshot_every_tokens`): a snapshot is taken where a forward ends,
    so a pass across that boundary would leave the disk none there (a prompt diverging past
    it then restores from further back). No limit without such snapshots."""
    every = cache.snapshot_every_tokens
    if not every:
        return sys.maxsize
    return every - cache.num_tokens % every - 1  # the pass feeds the token and the drafts


def _plain_stretch(
    model: nn.Module,
    cache: ModelCache,
    token: int,
    pick: TokenPicker,
    room: int,
    length: DraftLength,
    drafter: Drafter,
    make_room: Callable[[ModelCache, int], bool] | None,
    hand_over: Callable[[], bool] | None,
) -> Iterator[int]:
    """Plain decoding after `token` (fed first): at most `room` tokens (and no more than the
    pause left), ended where the drafter has a draft again or `hand_over` says so."""
    paused = length.paused_tokens
    watch = None if paused else drafter.can_propose  # ends the stretch at a match
    if hand_over:
        watch = _either(watch, hand_over)
    if make_room and not make_room(cache, 1):
        return iter(())
    step = cache.forward(model, mx.array([token], dtype=mx.uint32))[:, -1, :]
    return decode_tokens(model, cache, step, pick, min(room, paused or room), make_room, watch)


def _verify(
    model: nn.Module,
    cache: ModelCache,
    token: int,
    draft: Draft,
    pick: TokenPicker,
    rule: AcceptanceRule,
    make_room: Callable[[ModelCache, int], bool] | None,
) -> list[int]:
    """Feeds `token` and the drafts in one pass; returns the accepted drafts and the token
    drawn after them. The cache keeps `token` and the accepted drafts."""
    fed = [token, *draft.tokens]
    if make_room:
        make_room(cache, len(fed))
    logits, keep = cache.forward_tentative(model, fed)
    rows = logits[0]  # (len(fed), vocab)
    accepted: list[int] = []
    for i, drafted in enumerate(draft.tokens):
        logprobs = pick.logprobs(rows[i : i + 1])
        q = None if draft.probabilities is None else draft.probabilities[i]
        replacement = rule.check(logprobs, drafted, q)
        if replacement is not None:
            pick.record(replacement, logprobs)
            keep(1 + len(accepted))
            return [*accepted, int(replacement.item())]
        pick.record(mx.array([drafted], dtype=mx.uint32), logprobs)
        accepted.append(drafted)
    keep(len(fed))
    return [*accepted, int(pick(rows[-1:]).item())]


def _either(first: Callable[[], bool] | None, second: Callable[[], bool]) -> Callable[[], bool]:
    return second if first is None else lambda: first() or second()


def _one_hot(token: int, size: int) -> mx.array:
    return (mx.arange(size) == token).astype(mx.float32)
