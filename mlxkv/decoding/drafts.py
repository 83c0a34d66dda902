"""Where speculative decoding's drafts come from.

Owns: `DraftModel` (a draft model checked against the target; each conversation's cache
for it is kept on its prompt-cache entry), `NgramDrafter` (prompt lookup: the tokens that
followed an earlier occurrence of the text's last few tokens), `ModelDrafter` (drafts from
the draft model; its text and cache follow the target's when the window makes room),
`Draft`, and `DraftCounts` (a request's drafted and accepted tokens).
Does not own verification, the acceptance rule or how many tokens to draft (`speculative`).

Terms:
  text    the prompt and every token generated so far, the last one not yet fed to the model.
  draft   tokens proposed to follow the text, verified together in one forward pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxkv.cache.building import make_cache
from mlxkv.cache.layers.kv import Rotation
from mlxkv.cache.model_cache import ModelCache
from mlxkv.cache.prefix import common_prefix_length
from mlxkv.decoding.prefill.chunks import PrefillPlan, fill
from mlxkv.decoding.sampling import LogitsProcessor
from mlxkv.models.loading import LoadedModel
from mlxkv.models.rope import rope_rotations

# Suffix n-grams looked up, longest first. One token matches almost anywhere and drafts
# noise; more than 4 rarely matches where 4 does not.
MIN_NGRAM = 2
MAX_NGRAM = 4


@dataclass(frozen=True)
class Draft:
    """Proposed next tokens.

    Attributes:
        tokens: the drafted token ids, in order (empty: nothing to propose).
        probabilities: per drafted token, the distribution (1, vocab) it was sampled from; None
            when the drafts are deterministic (n-gram lookup, or a greedy draft model), which
            the acceptance rule treats as probability 1 on the drafted token.
    """

    tokens: list[int]
    probabilities: list[mx.array] | None = None


@dataclass
class DraftCounts:
    """Tokens drafted and verified in one request, and how many of them the model accepted."""

    drafted: int = 0
    accepted: int = 0


class NgramDrafter:
    """Drafts by prompt lookup: finds the most recent earlier occurrence of the text's last n
    tokens (n from 4 down to 2) and proposes the tokens that followed it. Costs a lookup per
    draft: the n-grams are indexed as the text grows, each time a draft is asked
    for, so an agent's prompt of tens of thousands of tokens is indexed after its reply's
    first token is out, not before (and never while the request decodes in a batch).

    The n-grams are keyed by a 64-bit hash, computed with numpy over the whole text at once
    and sorted (the text when the first draft is asked for: the prompt), plus a dictionary
    for the tokens generated after it: indexing a 32k-token prompt as a dictionary of tuples
    took 30-100 ms of Python on the engine thread, holding up the reply's second token; the
    sorted hashes take a few. A hash found is checked against the text's tokens, so a
    collision (never seen: 64 bits) only drafts nothing at that n; a draft is verified by the
    model anyway.

    Args:
        tokens: the text so far (prompt and the first generated token).
        vocab_size: ids at or past it end a draft: a vision prompt's image placeholders
            (`mlxkv.models.vision.PLACEHOLDER_BASE` and up) stand for pixels, not tokens the
            model could pick, and the acceptance rule would read their probability off the
            end of the logits. None: no such ids.
    """

    def __init__(self, tokens: Sequence[int], vocab_size: int | None = None):
        self._tokens: list[int] = list(map(int, tokens))
        self._vocab_size = vocab_size
        # per n, the text's first `_indexed` positions when first indexed: the hashes of the
        # n-grams before them, sorted, and the position after each (stable: latest last)
        self._sorted: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # per n, for positions indexed later: hash -> position after its latest occurrence
        self._recent: dict[int, dict[int, int]] = {n: {} for n in _NGRAM_SIZES}
        self._indexed = 0  # the positions below have their n-grams indexed

    def extend(self, tokens: Sequence[int]) -> None:
        """Appends tokens to the text."""
        self._tokens.extend(map(int, tokens))

    def can_propose(self) -> bool:
        """Whether `propose` would find a draft now."""
        return bool(self.propose(1).tokens)

    def propose(self, limit: int) -> Draft:
        """Up to `limit` tokens that followed the longest matching n-gram (none: no match)."""
        self._index()
        text, size = self._tokens, len(self._tokens)
        for n in range(min(MAX_NGRAM, size), MIN_NGRAM - 1, -1):
            suffix = text[size - n :]
            after = self._latest(n, _hash(suffix))
            if after is not None and text[after - n : after] == suffix:
                return Draft(self._tokens_only(text[after : after + limit]))
        return Draft([])

    def _tokens_only(self, draft: list[int]) -> list[int]:
        """`draft` up to its first id that is no token (`vocab_size`)."""
        if self._vocab_size is not None:
            for i, token in enumerate(draft):
                if token >= self._vocab_size:
                    return draft[:i]
        return draft

    def _latest(self, n: int, key: int) -> int | None:
        """The position after the latest n-gram indexed under hash `key` (None: none)."""
        if (after := self._recent[n].get(key)) is not None:
            return after
        if n not in self._sorted:
            return None
        hashes, positions = self._sorted[n]
        i = int(np.searchsorted(hashes, np.uint64(key), side="right")) - 1
        return int(positions[i]) if i >= 0 and hashes[i] == key else None

    def _index(self) -> None:
        """Indexes the n-grams ending before each position not indexed yet: all at once,
        sorted, the first time; into `_recent` after (a later occurrence replaces an earlier
        one)."""
        start, end = self._indexed, len(self._tokens)
        if start >= end:
            return
        # the new positions' n-grams reach back at most MAX_NGRAM tokens before `start`
        base = max(0, start - MAX_NGRAM)
        text = np.asarray(self._tokens[base:end], dtype=np.uint64)
        for n in _NGRAM_SIZES:
            first = max(start, n)  # the first such position with n tokens before it
            if first >= end:
                continue
            count, offset = end - first, first - n - base  # offset: the first n-gram's start
            hashes, multiplier = np.zeros(count, dtype=np.uint64), np.uint64(_HASH_MULTIPLIER)
            for i in range(n):
                hashes = hashes * multiplier + text[offset + i : offset + i + count]
            if start == 0:
                order = np.argsort(hashes, kind="stable")
                self._sorted[n] = hashes[order], order + first
            else:
                self._recent[n].update(zip(hashes.tolist(), range(first, end), strict=True))
        self._indexed = end


_NGRAM_SIZES = range(MIN_NGRAM, MAX_NGRAM + 1)
# An odd 64-bit constant (the golden ratio's): n-gram hashes are polynomials in it, mod 2**64.
_HASH_MULTIPLIER = 0x9E3779B97F4A7C15
_HASH_MASK = 2**64 - 1


def _hash(tokens: Sequence[int]) -> int:
    """The hash `NgramDrafter._index` gives these tokens, computed in Python ints."""
    value = 0
    for token in tokens:
        value = (value * _HASH_MULTIPLIER + token) & _HASH_MASK
    return value


class ModelDrafter:
    """Drafts with a small model that shares the target's tokenizer, one token per step.

    Its cache lives as long as the Runner: each request first brings it to the text's tokens
    (keeping the common prefix, like the prompt cache), so a conversation's drafts cost only
    the draft model's share of the new tokens. When the target's window makes room
    (`follow`), the text becomes what the target keeps, so drafting goes on past the
    window: a long reply keeps its speed-up where it is longest.

    Args:
        model: the draft model.
        cache: its cache (changed in place).
        tokens: the text so far.
        distribution: logprobs (1, vocab) -> the probabilities to sample drafts from; None for
            greedy drafts.
        plan: how the draft model is fed the text it has not seen.
        rotations: the draft model's per-layer key rotations (`rope_rotations`), for shifting
            its cache in place as the target's shifts.
        vocab_size: the target's logits width; the draft's are cut or padded to it
            (`_to_width`) before the processors, which index them by the target's ids.
        own_vocab_size: the draft's embedding rows: a text id past them (a padded id the
            target picked) is fed to the draft as id 0, which it can read (its embedding
            gathered out of bounds, a SIGSEGV far past the end); its drafts after that id
            are only less likely accepted.
        processors: the request's stateless logits processors (penalties, logit bias), applied
            to the draft's logits with the same history as the target's picker: drafts from
            raw logits were accepted less often (34 of 42 with a repetition penalty, 23 of 41
            with a logit bias, against all without, the model drafting for itself). Not a
            grammar's: its state follows the target's tokens only.
    """

    def __init__(
        self,
        model: nn.Module,
        cache: ModelCache,
        tokens: Sequence[int],
        distribution: Callable[[mx.array], mx.array] | None,
        plan: PrefillPlan,
        rotations: Sequence[Rotation | None],
        vocab_size: int,
        own_vocab_size: int,
        processors: Sequence[LogitsProcessor] = (),
    ):
        self._model = model
        self._cache = cache
        self._own_vocab_size = own_vocab_size
        self._tokens = self._readable(tokens)  # the text as the draft model is fed it
        self._distribution = distribution
        self._plan = plan
        self._rotations = rotations
        self._vocab_size = vocab_size
        self._processors = tuple(processors)
        # every token since the prompt's first, as `TokenPicker` keeps it (never shifted)
        self._history = mx.array(list(tokens), dtype=mx.uint32) if processors else None

    def _readable(self, tokens: Sequence[int]) -> list[int]:
        """`tokens` with each id past the draft's embedding rows replaced by 0."""
        return [int(t) if t < self._own_vocab_size else 0 for t in tokens]

    def extend(self, tokens: Sequence[int]) -> None:
        self._tokens.extend(self._readable(tokens))
        if self._history is not None and tokens:
            added = mx.array([int(t) for t in tokens], dtype=mx.uint32)
            self._history = mx.concatenate([self._history, added])

    def can_propose(self) -> bool:
        return True  # a draft model always drafts (the target verifies it)

    def propose(self, limit: int) -> Draft:
        """Up to `limit` drafts; none while its cache is still catching up with the text."""
        if not self._catch_up():
            return Draft([])
        feed = mx.array(self._tokens[-1:], dtype=mx.uint32)
        drafted, probabilities = [], []
        history = self._history
        for _ in range(limit):
            logits = _to_width(self._cache.forward(self._model, feed)[:, -1, :], self._vocab_size)
            if history is not None:
                for processor in self._processors:
                    logits = processor(history, logits)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            if self._distribution is None:
                feed = mx.argmax(logprobs, axis=-1).astype(mx.uint32)
            else:
                q = self._distribution(logprobs)
                feed = mx.random.categorical(mx.log(q)).astype(mx.uint32)
                probabilities.append(q)
            drafted.append(feed)
            if history is not None:
                history = mx.concatenate([history, feed])
        if not drafted:
            return Draft([])
        tokens = mx.concatenate(drafted)
        mx.eval(tokens, *probabilities)
        return Draft(tokens.tolist(), probabilities if self._distribution else None)

    def follow(self, keep: int, drop: int, num_held: int) -> None:
        """Drops the text's tokens [keep, keep + drop), as the target's window just did from
        the first `num_held` tokens of the text that it held (`ContextWindow.on_shift`). The
        draft cache is shifted the same way in place where it can be (float K/V with a known
        RoPE: a rotation of its keys, the target's approximation), from the tokens the target
        held only: a token after them goes on to be fed after the shift, in the kept context,
        as the target feeds it. Elsewhere `_catch_up` prefills the kept text again, a chunk
        per draft asked for, as the target's window did."""
        cache = self._cache
        held = min(common_prefix_length(cache.tokens, self._tokens), num_held)
        del self._tokens[keep : keep + drop]
        if keep + drop <= held and cache.can_shift(self._rotations):
            cache.trim_to(held)
            cache.shift(keep, drop, self._rotations)

    def _catch_up(self) -> bool:
        """Brings the draft cache toward the text but its last token (which `propose` feeds),
        by at most one chunk (`PrefillPlan.step_tokens`): True once it holds them. A long
        text to catch up with (a new conversation's prompt, the kept text after a shift the
        draft cache cannot follow in place) is so spread over plain decoding steps, between
        which a cancel or a request joining the batch is seen, instead of seconds in one call.
        """
        target = self._tokens[:-1]
        common = common_prefix_length(self._cache.tokens, target)
        common = self._cache.nearest_restorable(common)
        if common < self._cache.num_tokens:
            self._cache.rewind_to(common)
        chunk = target[common : common + self._plan.step_tokens]
        if chunk:
            fill(self._model, self._cache, chunk, self._plan)
        return common + len(chunk) == len(target)


def _to_width(logits: mx.array, width: int) -> mx.array:
    """`logits` (1, vocab) over `width` tokens: cut (the target has no logit for the ids
    past it), or padded with -inf (never drafted). Tables of one tokenizer are padded apart
    (Qwen2.5-0.5B's 151,936 rows, 7B's 152,064): a processor indexing a narrower draft's
    logits at a target id past their end (a bias, a penalty's history) read and wrote out of
    bounds, and the process died with SIGSEGV."""
    have = logits.shape[-1]
    if have == width:
        return logits
    if have > width:
        return logits[:, :width]
    padding = mx.full((logits.shape[0], width - have), -mx.inf, dtype=logits.dtype)
    return mx.concatenate([logits, padding], axis=-1)


class DraftModel:
    """A draft model; each conversation's cache for it lives on its prompt-cache entry
    (`make_cache`), so interleaved conversations do not re-prefill each other's.

    Args:
        loaded: the draft model; its tokenizer must map text to the same ids as the target's.
        vocab_size: the target's logits width (its embedding table may be padded apart).
    """

    def __init__(self, loaded: LoadedModel, vocab_size: int):
        self.loaded = loaded
        self.vocab_size = vocab_size
        self._rotations = rope_rotations(loaded.model)

    def make_cache(self) -> ModelCache:
        return make_cache(self.loaded.model)

    @classmethod
    def check(cls, draft: LoadedModel | None, target: LoadedModel) -> DraftModel | None:
        """Wraps `draft` after checking its tokenizer against `target`'s (None: no draft).

        Raises:
            ValueError: the vocabularies differ.
        """
        if draft is None:
            return None
        ours, theirs = draft.tokenizer.vocab, target.tokenizer.vocab
        if ours != theirs:
            differing = len(set(ours.items()) ^ set(theirs.items()))
            raise ValueError(
                f"the draft model's tokenizer ({len(ours):,} tokens) differs from the model's "
                f"({len(theirs):,} tokens; {differing:,} entries differ): drafts would be other "
                "tokens. Use a draft model from the same family (same tokenizer)"
            )
        return cls(draft, target.vocab_size)

    def drafter(
        self,
        cache: ModelCache,
        tokens: Sequence[int],
        distribution: Callable[[mx.array], mx.array] | None,
        plan: PrefillPlan,
        processors: Sequence[LogitsProcessor] = (),
    ) -> ModelDrafter:
        """A drafter for `tokens` on `cache` (the conversation's, from `make_cache`), which
        it rewinds and fills to match them, drafting through `processors` (`ModelDrafter`)."""
        return ModelDrafter(
            self.loaded.model,
            cache,
            tokens,
            distribution,
            plan,
            self._rotations,
            self.vocab_size,
            self.loaded.vocab_size,
            processors,
        )
