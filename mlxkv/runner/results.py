"""What a generation returns: the `Completion`, the streamed `GenerationChunk`s, and the
per-request `CompletionStats` that becomes the Completion at the end.

Owns the result types and their counting. Does not own how tokens are produced (`decoding`)
or turned into text (`text.chunks`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx

from mlxkv.decoding.drafts import DraftCounts
from mlxkv.decoding.picker import TokenLogprob
from mlxkv.decoding.prefill.scoring import PromptLogprobs


@dataclass(frozen=True)
class Completion:
    """The result of one generation.

    Attributes:
        text: generated text, without the EOS token and cut before any stop string.
        tokens: generated token ids (without EOS).
        finish_reason: "stop" (EOS or a stop string), "length" (max_tokens or the context
            limit) or "cancelled" (`Runner.cancel()`, during prefill or decode).
        prompt_tokens: tokens in the prompt.
        cached_tokens: prompt tokens whose K/V were reused from the prompt cache.
        prompt_tps: prompt tokens processed (not reused) per second of prefill.
        generation_tokens: tokens sampled, EOS included.
        generation_tps: sampled tokens per second after the first one (mlx-lm's measure).
        ttft: seconds from the request to the first sampled token.
        peak_memory: MLX's peak memory during the request, in bytes.
        stop_string: the stop string that ended it, if one did.
        drafted_tokens: tokens proposed by speculative decoding and verified by the model.
        accepted_tokens: drafted tokens the model accepted (each saved a forward pass).
    """

    text: str
    tokens: list[int]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    ttft: float
    peak_memory: int
    stop_string: str | None = None
    drafted_tokens: int = 0
    accepted_tokens: int = 0


@dataclass(frozen=True, kw_only=True)
class PromptUsage:
    """The prompt's size and how much of it the prompt cache supplied, in tokens."""

    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class GenerationChunk:
    """One piece of a streamed generation.

    Attributes:
        text: text added by this chunk (may be empty while a stop string could be forming).
        token: the token sampled for this chunk; None on the final chunk.
        finish_reason: set on the final chunk only.
        completion: the whole result with its statistics, on the final chunk only.
        logprob: the token's log-probabilities when the request asked for them.
        prompt: on the first token's chunk and on the final chunk: the prompt's tokens and
            cached tokens (known before any text, e.g. for a response header).
        prompt_logprobs: where the request asked for them, on the chunks with `prompt`: the
            prompt's own log-probabilities.
        end_token: on the final chunk of a reply that EOS ended: that token (sampled and
            counted in `generation_tokens`, never streamed as text).
        end_logprob: with `end_token`, its log-probabilities when the request asked for them.
    """

    text: str
    token: int | None
    finish_reason: str | None = None
    completion: Completion | None = None
    logprob: TokenLogprob | None = None
    prompt: PromptUsage | None = None
    prompt_logprobs: PromptLogprobs | None = None
    end_token: int | None = None
    end_logprob: TokenLogprob | None = None


class CompletionStats:
    """Timing and counts of one request, turned into a Completion at the end.

    Args:
        start: `time.perf_counter()` when the request began.
        prompt_tokens: tokens of the (fitted) prompt.
        cached: prompt tokens reused from the cache.
    """

    def __init__(self, start: float, *, prompt_tokens: int, cached: int):
        self.start = start
        self.prompt_tokens = prompt_tokens
        self.cached = cached
        self.processed = 0
        self.first_token_at: float | None = None
        self.num_sampled = 0
        self.tokens: list[int] = []
        self.text: list[str] = []
        self.drafts = DraftCounts()  # speculative decoding's, filled in as it verifies
        self.prompt_logprobs: PromptLogprobs | None = None  # once scored, when asked for

    def sampled(self) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.num_sampled += 1

    def chunk(self, token: int, text: str, logprob: TokenLogprob | None) -> GenerationChunk:
        """Records a streamed token and its text; returns its chunk (the first token's carries
        the prompt's usage)."""
        self.tokens.append(token)
        self.text.append(text)
        first = self.num_sampled == 1
        return GenerationChunk(
            text=text,
            token=token,
            logprob=logprob,
            prompt=self.usage() if first else None,
            prompt_logprobs=self.prompt_logprobs if first else None,
        )

    def final_chunk(
        self,
        text: str,
        finish_reason: str,
        stop_string: str | None = None,
        end: tuple[int, TokenLogprob | None] | None = None,
    ) -> GenerationChunk:
        """The last chunk of a stream: its text, the reason it ended and the Completion; `end`:
        the EOS token that ended it, and its log-probabilities."""
        end_token, end_logprob = end or (None, None)
        return GenerationChunk(
            text=text,
            token=None,
            finish_reason=finish_reason,
            completion=self.completion(finish_reason, stop_string),
            prompt=self.usage(),
            prompt_logprobs=self.prompt_logprobs,
            end_token=end_token,
            end_logprob=end_logprob,
        )

    def usage(self) -> PromptUsage:
        return PromptUsage(prompt_tokens=self.prompt_tokens, cached_tokens=self.cached)

    def completion(self, finish_reason: str, stop_string: str | None = None) -> Completion:
        end = time.perf_counter()
        first = self.first_token_at or end
        prefill_s = first - self.start
        decode_s = end - first
        return Completion(
            text="".join(self.text),
            tokens=list(self.tokens),
            finish_reason=finish_reason,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached,
            prompt_tps=self.processed / prefill_s if prefill_s > 0 else 0.0,
            generation_tokens=self.num_sampled,
            generation_tps=self.num_sampled / decode_s if decode_s > 0 else 0.0,
            ttft=prefill_s,
            peak_memory=mx.get_peak_memory(),
            stop_string=stop_string,
            drafted_tokens=self.drafts.drafted,
            accepted_tokens=self.drafts.accepted,
        )
