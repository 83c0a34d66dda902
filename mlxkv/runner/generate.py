"""Prefill and decode on a ModelCache, plus the results they produce.

Owns: `prefill` (the prompt in chunks), `decode_tokens` (the pipelined token loop), stop-string
matching on streamed text, and the `Completion` / `GenerationChunk` results. Does not own the
prompt cache policy (`mlxkv.cache.pool`) or sampling math (mlx-lm).

The decode loop keeps the device busy the way mlx-lm's does: step n+1 is queued with
`mx.async_eval` before token n is read back into Python, so the host never waits on the device
for bookkeeping. Everything runs on MLX's default stream, not mlx-lm's thread-local
`generation_stream`: the cache outlives a request and may be continued from another thread,
and arrays built on one thread's local stream cannot be evaluated on another.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from mlxkv.cache.model_cache import ModelCache
from mlxkv.runner import prefill_lanes
from mlxkv.runner.sampling import LogitsProcessor, Sampler

ProgressCallback = Callable[[int, int], None]

# MLX keeps freed buffers for reuse; returning them every so often bounds that pool, as mlx-lm
# does (https://github.com/ml-explore/mlx-lm/blob/main/mlx_lm/generate.py, generate_step).
_CLEAR_CACHE_EVERY_TOKENS = 256


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


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probabilities (natural log) at one generated token.

    Attributes:
        logprob: the sampled token's.
        top: the most likely tokens and theirs, most likely first: ((token id, logprob), ...).
    """

    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
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
    """

    text: str
    token: int | None
    finish_reason: str | None = None
    completion: Completion | None = None
    logprob: TokenLogprob | None = None
    prompt: PromptUsage | None = None


class PrefillCancelled(Exception):
    """Raised between prefill chunks when the request was cancelled; the chunks already fed
    stay in the cache."""


class CompletionStats:
    """Timing and counts of one request, turned into a Completion at the end.

    Args:
        start: `time.perf_counter()` when the request began.
        prompt_tokens: tokens of the (fitted) prompt.
        cached: prompt tokens reused from the cache.
    """

    def __init__(self, start: float, prompt_tokens: int, cached: int):
        self.start = start
        self.prompt_tokens = prompt_tokens
        self.cached = cached
        self.processed = 0
        self.first_token_at: float | None = None
        self.num_sampled = 0
        self.tokens: list[int] = []
        self.text: list[str] = []
        self.drafted = 0  # speculative decoding: tokens drafted, and accepted of them
        self.accepted = 0

    def sampled(self) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.num_sampled += 1

    def final_chunk(
        self, text: str, finish_reason: str, stop_string: str | None = None
    ) -> GenerationChunk:
        """The last chunk of a stream: its text, the reason it ended and the Completion."""
        return GenerationChunk(
            text=text,
            token=None,
            finish_reason=finish_reason,
            completion=self.completion(finish_reason, stop_string),
            prompt=self.usage(),
        )

    def usage(self) -> PromptUsage:
        return PromptUsage(self.prompt_tokens, self.cached)

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
            drafted_tokens=self.drafted,
            accepted_tokens=self.accepted,
        )


def fill(
    model: nn.Module,
    cache: ModelCache,
    tokens: Sequence[int],
    *,
    step_tokens: int,
    progress: ProgressCallback | None = None,
) -> None:
    """Feeds `tokens` into the cache in chunks of at most `step_tokens`, computing no logits:
    only the cache's arrays are evaluated, so MLX never runs the vocabulary projection for them
    (as in mlx-lm). On the CPU backend each chunk is spread over the cores (`prefill_lanes`).

    Args:
        progress: called as progress(done, len(tokens)) in tokens after each chunk.
    """
    total = len(tokens)
    for start in range(0, total, step_tokens):
        end = min(start + step_tokens, total)
        prefill_lanes.feed(model, cache, tokens[start:end])
        if progress:
            progress(end, total)
        mx.clear_cache()


def prefill(
    model: nn.Module,
    cache: ModelCache,
    tokens: Sequence[int],
    *,
    step_tokens: int,
    progress: ProgressCallback | None = None,
) -> mx.array:
    """Feeds `tokens` through the model: all but the last with `fill`, the last alone for the
    logits generation starts from.

    Args:
        tokens: at least one token id, fed after what `cache` holds (which grows in place).
        progress: called as progress(done, total) in tokens after each chunk.

    Returns:
        Logits of the last token, shape (1, vocab), lazy.
    """
    total = len(tokens)
    body_progress = (lambda done, _: progress(done, total)) if progress else None
    fill(model, cache, tokens[:-1], step_tokens=step_tokens, progress=body_progress)
    logits = cache.forward(model, tokens[-1:])[:, -1, :]
    if progress:
        progress(total, total)
    return logits


class TokenPicker:
    """Turns logits into the next token: logits processors (with the token history), then the
    sampler. Keeps the history lazily on the device.

    With `top_logprobs` set it also keeps, per picked token and in pick order, the token's
    log-probability and the `top_logprobs` most likely alternatives (after the logits
    processors, before temperature: what the model assigns, as OpenAI reports it).
    """

    def __init__(
        self,
        sampler: Sampler,
        processors: list[LogitsProcessor],
        history: Sequence[int],
        *,
        top_logprobs: int | None = None,
    ):
        self._sampler = sampler
        self._processors = processors
        self._history = mx.array(list(history), dtype=mx.uint32) if processors else None
        self._top_logprobs = top_logprobs
        self._pending: deque[tuple[mx.array, mx.array, mx.array]] = deque()

    def __call__(self, logits: mx.array) -> mx.array:
        logprobs = self.logprobs(logits)
        token = self._sampler(logprobs).reshape(-1)
        self.record(token, logprobs)
        return token

    def logprobs(self, logits: mx.array) -> mx.array:
        """Log-probabilities (1, vocab) of the next token: logits (1, vocab) through the
        processors, given the tokens recorded so far; before any sampler filter."""
        for processor in self._processors:
            logits = processor(self._history, logits)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def record(self, token: mx.array, logprobs: mx.array) -> None:
        """Takes `token` (shape (1,)) as the next token, picked from `logprobs`."""
        if self._history is not None:
            self._history = mx.concatenate([self._history, token.astype(mx.uint32)])
        if self._top_logprobs is not None:
            row = logprobs[0]
            k = self._top_logprobs
            top = mx.argsort(-row)[:k] if k else mx.array([], dtype=mx.uint32)
            self._pending.append((row[token[0]], top, row[top]))

    def pop_logprob(self) -> TokenLogprob | None:
        """The log-probabilities of the oldest picked token not yet popped; None when not
        asked for."""
        if self._top_logprobs is None:
            return None
        own, top, values = self._pending.popleft()
        alternatives = tuple(zip(top.tolist(), values.tolist(), strict=True))
        return TokenLogprob(own.item(), alternatives)


def decode_tokens(
    model: nn.Module,
    cache: ModelCache,
    logits: mx.array,
    pick: TokenPicker,
    max_tokens: int,
    make_room: Callable[[ModelCache, int], None] | None = None,
    stop_early: Callable[[], bool] | None = None,
) -> Iterator[int]:
    """Yields up to `max_tokens` sampled token ids, starting from the prompt's last logits.

    Pipelined: every yielded token except the first and the last has already been fed to the
    model (its step is queued before it is yielded). The first is yielded as soon as it exists,
    then fed. Either way `cache` records exactly what was fed, so the caller may stop early by
    closing the generator.

    Args:
        make_room: called as make_room(cache, 1) before each token is fed (context shift).
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
        if n + 1 < max_tokens:
            if make_room:
                make_room(cache, 1)
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


class StopStrings:
    """Cuts streamed text at the first stop string, holding back text that may start one."""

    def __init__(self, stops: Sequence[str]):
        self._stops = tuple(stops)
        self._held = ""
        self.matched: str | None = None  # the stop string found, once one is

    def push(self, segment: str) -> tuple[str, bool]:
        """Adds a text segment; returns (text safe to emit now, whether a stop string ended it)."""
        text = self._held + segment
        found = [(i, s) for s in self._stops if (i := text.find(s)) >= 0]
        if found:
            self._held = ""
            start, self.matched = min(found)
            return text[:start], True
        hold = partial_suffix_length(text, self._stops)
        self._held = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], False

    def flush(self) -> str:
        """Text held back at the end of generation (it did not become a stop string)."""
        text, self._held = self._held, ""
        return text


def partial_suffix_length(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of `text` that is a proper beginning of one of `markers`:
    what must be held back because the next text may complete a marker."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest
