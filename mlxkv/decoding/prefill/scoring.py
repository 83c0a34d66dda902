"""A prompt's own log-probabilities: each prompt token's, given the tokens before it, read
from the logits of the prefill chunks that feed them (OpenAI's `echo` with `logprobs`, how
lm-evaluation-harness scores a continuation).

Owns `PromptScorer` (fed chunk by chunk, `chunks.fill_steps`) and `PromptLogprobs` (what it
gives). The raw model's: no logits processor (penalties, bias, grammar) applies to a prompt.
Does not own which positions are fed again (`mlxkv.runner.request_run`: a cached prefix's
K/V hold no logits).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from mlxkv.decoding.picker import TokenLogprob

# Most prompt tokens per model call of a prefill that scores: each chunk's logits over the
# whole vocabulary are kept and copied in float32 (2,048 positions of a 152k vocabulary are
# 1.2 GB a copy; 256 are 156 MB).
SCORED_STEP_TOKENS = 256


@dataclass(frozen=True)
class PromptLogprobs:
    """A prompt's tokens and the log-probabilities of each but the first (`logprobs[i]` is
    `tokens[i + 1]`'s), with its most likely alternatives."""

    tokens: list[int]
    logprobs: list[TokenLogprob]


class PromptScorer:
    """Collects the log-probabilities of `tokens` from logits of any of its positions, in any
    order (a position scored again replaces what it had), `top` alternatives each."""

    def __init__(self, tokens: Sequence[int], top: int):
        self._tokens = list(tokens)
        self._targets = mx.array(self._tokens[1:], dtype=mx.uint32)
        self._top = top
        self._parts: dict[int, tuple[mx.array, mx.array, mx.array]] = {}

    def score(self, logits: mx.array, start: int) -> list[mx.array]:
        """Takes logits (1, L, vocab) of positions `start`.. (the next token's at each);
        returns the arrays it keeps, lazy, to evaluate with the chunk."""
        targets = self._targets[start : start + logits.shape[1]]
        if targets.size == 0:  # the prompt's last position: the reply's first token
            return []
        rows = logits[0, : targets.size].astype(mx.float32)
        rows = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
        own = mx.take_along_axis(rows, targets[:, None], axis=-1)[:, 0]
        if self._top:
            top = mx.argpartition(-rows, kth=self._top - 1, axis=-1)[:, : self._top]
            values = mx.take_along_axis(rows, top, axis=-1)
        else:
            top = values = mx.zeros((targets.size, 0))
        self._parts[start] = (own, top, values)
        return [own, top, values]

    def result(self) -> PromptLogprobs:
        """The prompt's log-probabilities; every position but the last must have been
        scored."""
        logprobs: list[TokenLogprob] = []
        for start in sorted(self._parts):
            if start != len(logprobs):
                raise RuntimeError(f"prompt positions {len(logprobs)}..{start} never scored")
            own, top, values = (part.tolist() for part in self._parts[start])
            for value, ids, tops in zip(own, top, values, strict=True):
                pairs = sorted(zip(ids, tops, strict=True), key=lambda pair: -pair[1])
                alternatives = tuple((int(i), v) for i, v in pairs if math.isfinite(v))
                logprobs.append(TokenLogprob(value, alternatives))
        if len(logprobs) != len(self._tokens) - 1:
            raise RuntimeError(f"prompt positions {len(logprobs)}.. never scored")
        return PromptLogprobs(self._tokens, logprobs)
