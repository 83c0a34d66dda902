"""Runner: load a model once, then generate with a prompt cache that survives between requests.

Owns: the request path (validate -> prefix lookup -> prefill the rest -> decode -> report),
serializing requests from several threads, and the memory log line after each generation.

Invariant, however a request ends (normal end, stop string, the caller leaving `stream()`
early, an exception in a callback, KeyboardInterrupt, `cancel()`): the prompt-cache entry's
token list equals what its caches hold, and the next request reuses exactly that. This holds
because every model call goes through `ModelCache.forward`, which is all or nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxkv.cache.model_cache import ModelCache, make_cache
from mlxkv.cache.prefix import PrefixCache, PrefixHit, common_prefix_length
from mlxkv.runner.context import (
    DEFAULT_KEEP_TOKENS,
    ContextWindow,
    check_keep,
    fit_prompt,
    rope_rotations,
)
from mlxkv.runner.generate import (
    Completion,
    GenerationChunk,
    ProgressCallback,
    StopStrings,
    TokenPicker,
    decode_tokens,
    fill,
    prefill,
)
from mlxkv.runner.loading import LoadedModel, load_model
from mlxkv.runner.memory import MemoryReport
from mlxkv.runner.prompt import Message, Prompt, encode_prompt
from mlxkv.runner.sampling import SamplingParams

logger = logging.getLogger(__name__)


class Runner:
    """A loaded model plus its prompt cache.

    Args:
        loaded: the model and tokenizer (see `Runner.load`).
        max_context: most tokens (prompt + generated) the cache holds; None uses the model's
            `max_position_embeddings`, capped to what half the machine's memory can hold.
            Longer prompts are cut from the front; generation that reaches it shifts the cache.
        keep: tokens at the start that truncation and shifts never drop; None keeps the system
            prompt's tokens for chat messages, else the first 4.
        kv_bits: quantize global-attention K/V to 8 or 4 bits; None keeps the model's dtype.
        kv_group_size: head-dimension elements per quantization scale.
        prefill_step_size: most prompt tokens fed per model call; bounds prefill memory.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        max_context: int | None = None,
        keep: int | None = None,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        prefill_step_size: int = 512,
    ):
        if max_context is not None and max_context < 2:
            raise ValueError(f"max_context must be at least 2 tokens, got {max_context}")
        if keep is not None and keep < 0:
            raise ValueError(f"keep must be >= 0 tokens, got {keep}")
        if prefill_step_size < 1:
            raise ValueError(f"prefill_step_size must be >= 1 token, got {prefill_step_size}")
        self.loaded = loaded
        self.keep = keep
        self.prefill_step_size = prefill_step_size
        cache = make_cache(loaded.model, kv_bits=kv_bits, kv_group_size=kv_group_size)
        self.max_context = max_context or default_max_context(loaded, cache)
        cache.capacity_tokens = self.max_context  # the window is enforced by the cache too
        self._rotations = rope_rotations(loaded.model)
        self._prefix = PrefixCache(cache)
        self._lock = threading.Lock()
        self._cancel = threading.Event()

    @classmethod
    def load(
        cls,
        path_or_repo: str | Path | None = None,
        *,
        max_context: int | None = None,
        keep: int | None = None,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        prefill_step_size: int = 512,
    ) -> Runner:
        """Loads a model and wraps it in a Runner.

        Args:
            path_or_repo: a Hugging Face-layout directory, a .gguf file, an Ollama model name,
                a Hugging Face repo id, or None for the bundled default (SmolLM2-135M-Instruct).

        Raises:
            ModelLoadError: nothing loadable at `path_or_repo` (the message says what was tried).
            ValueError: invalid cache or context settings.
        """
        return cls(
            load_model(path_or_repo),
            max_context=max_context,
            keep=keep,
            kv_bits=kv_bits,
            kv_group_size=kv_group_size,
            prefill_step_size=prefill_step_size,
        )

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    def encode(self, prompt: Prompt) -> list[int]:
        """The token ids a prompt becomes (chat messages through the chat template)."""
        return encode_prompt(self.loaded.tokenizer, prompt, self.loaded.vocab_size)

    def generate(
        self, prompt: Prompt, *, progress: ProgressCallback | None = None, **sampling: Any
    ) -> Completion:
        """Generates a whole completion. Takes the same arguments as `stream`."""
        chunks = list(self.stream(prompt, progress=progress, **sampling))
        return chunks[-1].completion

    def stream(
        self, prompt: Prompt, *, progress: ProgressCallback | None = None, **sampling: Any
    ) -> Iterator[GenerationChunk]:
        """Streams a completion chunk by chunk.

        Args:
            prompt: a string, token ids, or chat messages ([{"role": ..., "content": ...}]).
            progress: called as progress(done, total) in prompt tokens during prefill.
            **sampling: `SamplingParams` fields: max_tokens, temperature, top_p, top_k, min_p,
                repetition_penalty, seed, stop.

        Returns:
            An iterator of chunks; the last one has `finish_reason` and `completion`. Leaving
            the loop early is safe: the cache keeps what was fed.

        Raises:
            ValueError: bad prompt or sampling settings (raised here, before anything changes).
            ContextLengthError: `keep` leaves no room in `max_context`.
        """
        params = SamplingParams(**sampling)
        tokens = self.encode(prompt)
        keep = self._keep_for(prompt, tokens)
        # A prompt that must be cut leaves room to answer, so the answer does not begin with a
        # shift; it is cut later, under the lock, where the cache's contents are known.
        budget = self.max_context
        if len(tokens) > self.max_context:
            budget -= max(1, min(params.max_tokens, self.max_context // 4))
        check_keep(keep, budget)
        header = self._generation_prompt_length(prompt)
        return self._stream(_Request(prompt, tokens, keep, budget, header, params, progress))

    def _fit(self, request: _Request) -> list[int]:
        """The request's tokens cut to its budget, reusing the cache where a cut allows."""
        if len(request.tokens) <= request.budget:
            return request.tokens
        return fit_prompt(
            request.tokens,
            request.budget,
            request.keep,
            held=self._prefix.entry.tokens,
            **self._drops(request.prompt),
        )

    def _generation_prompt_length(self, prompt: Prompt) -> int:
        """Tokens the chat template appends to open the assistant's turn (at least 1): the next
        turn re-renders from there, so it is where a checkpoint is most useful."""
        if not _is_messages(prompt):
            return 1
        with_header = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True)
        without = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=False)
        return max(1, len(with_header) - common_prefix_length(list(without), list(with_header)))

    def _keep_for(self, prompt: Prompt, tokens: list[int]) -> int:
        """Tokens truncation and shifts never drop: the setting, else the system prompt."""
        if self.keep is not None:
            return self.keep
        system = _leading_system_messages(prompt)
        if not system:
            return min(DEFAULT_KEEP_TOKENS, len(tokens))
        rendered = self.tokenizer.apply_chat_template(system, add_generation_prompt=False)
        return common_prefix_length(list(rendered), tokens)

    def _drops(self, prompt: Prompt) -> dict:
        """How `fit_prompt` may drop whole chat messages (none for text or token prompts)."""
        if not _is_messages(prompt):
            return {}
        system = _leading_system_messages(prompt)
        users = [i for i, m in enumerate(prompt) if i > len(system) and m.get("role") == "user"]
        return {
            "render_from": lambda first: self.encode(system + list(prompt[first:])),
            "num_messages": len(prompt),
            "first_droppable": len(system),
            "cut_points": users,
        }

    def _stream(self, request: _Request) -> Iterator[GenerationChunk]:
        with self._lock:
            self._cancel.clear()
            mx.reset_peak_memory()
            try:
                yield from self._run(request)
            finally:
                self._prefix.entry.materialize()
                self._log_memory()

    def _prefill(self, request: _Request, tokens: list[int]) -> tuple[mx.array, PrefixHit]:
        """Reuses what the cache holds and feeds the rest; checkpoints the layers that cannot
        trim where the generation prompt starts (the next turn re-renders from there)."""
        hit = self._prefix.fetch_nearest(tokens)
        model, cache, remaining = self.loaded.model, hit.cache, hit.remaining
        total, progress = len(remaining), request.progress
        split = len(tokens) - request.header_tokens - hit.num_cached
        if cache.needs_checkpoints and 0 < split < total:
            fill(model, cache, remaining[:split], step_tokens=self._step, progress=progress)
            cache.checkpoint()
            remaining = remaining[split:]
            progress = progress and (lambda done, _: request.progress(split + done, total))
        logits = prefill(model, cache, remaining, step_tokens=self._step, progress=progress)
        return logits, hit

    @property
    def _step(self) -> int:
        """Prefill chunk size: never more than the context can hold."""
        return min(self.prefill_step_size, self.max_context)

    def _run(self, request: _Request) -> Iterator[GenerationChunk]:
        start = time.perf_counter()
        params, tokens = request.params, self._fit(request)
        if params.seed is not None:
            mx.random.seed(params.seed)
        logits, hit = self._prefill(request, tokens)
        model = self.loaded.model
        window = ContextWindow(
            self.max_context,
            request.keep,
            self._rotations,
            refill=lambda cache, ids: fill(model, cache, ids, step_tokens=self._step),
        )
        pick = TokenPicker(params.make_sampler(), params.make_logits_processors(), tokens)
        stats = _Stats(start, len(tokens), hit.num_cached, len(hit.remaining))
        decoded = decode_tokens(model, hit.cache, logits, pick, params.max_tokens, window.make_room)
        yield from self._emit(decoded, stats, params)

    def _emit(
        self, decoded: Iterator[int], stats: _Stats, params: SamplingParams
    ) -> Iterator[GenerationChunk]:
        """Turns sampled tokens into text chunks: EOS, stop strings and cancel end them."""
        tokenizer = self.loaded.tokenizer
        stops = StopStrings(params.stop)
        detokenizer = tokenizer.detokenizer
        detokenizer.reset()
        finish, cut_by_stop_string = "length", False
        for token in decoded:
            stats.sampled()
            if token in tokenizer.eos_token_ids:
                finish = "stop"
                break
            detokenizer.add_token(token)
            stats.tokens.append(token)
            text, stopped = stops.push(detokenizer.last_segment)
            stats.text.append(text)
            yield GenerationChunk(text=text, token=token)
            if stopped:
                finish, cut_by_stop_string = "stop", True
                break
            if self._cancel.is_set():
                finish = "cancelled"
                break
        tail = ""
        if not cut_by_stop_string:
            detokenizer.finalize()
            tail, _ = stops.push(detokenizer.last_segment)
            tail += stops.flush()
            stats.text.append(tail)
        completion = stats.completion(finish)
        yield GenerationChunk(text=tail, token=None, finish_reason=finish, completion=completion)

    def cancel(self) -> None:
        """Asks the generation in progress (from another thread) to end after its next token,
        with finish_reason "cancelled". The cache keeps every token fed so far."""
        self._cancel.set()

    def cache_info(self) -> MemoryReport:
        """Tokens held by the prompt cache and its bytes (waits for a running generation)."""
        with self._lock:
            return MemoryReport.measure(self._prefix.entry)

    @property
    def cache_tokens(self) -> list[int]:
        """The token ids the prompt cache holds (a copy; waits for a running generation)."""
        with self._lock:
            return self._prefix.entry.tokens

    def reset(self) -> None:
        """Drops the prompt-cache entry and its memory."""
        with self._lock:
            self._prefix.clear()

    def _log_memory(self) -> None:
        logger.info("%s", MemoryReport.measure(self._prefix.entry).log_line())


def default_max_context(loaded: LoadedModel, cache: ModelCache) -> int:
    """The model's own maximum, capped to the tokens whose K/V fit in half the machine's
    memory (measured by feeding one token through a scratch copy of the cache layout)."""
    scratch = cache.copy()
    scratch.forward(loaded.model, [0])
    per_token = max(scratch.used_bytes, 1)
    budget = _physical_memory_bytes() // 2
    fits = max(2, budget // per_token)
    return min(loaded.max_position_embeddings or fits, fits)


def _physical_memory_bytes() -> int:
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30  # unknown: assume 8 GiB


@dataclass(frozen=True)
class _Request:
    """One validated request.

    Attributes:
        tokens: the whole prompt, before any cut to the context.
        keep: leading tokens no cut or shift drops.
        budget: most prompt tokens that may be fed (the context less room to answer).
        header_tokens: tokens of the template's generation prompt at the end.
    """

    prompt: Prompt
    tokens: list[int]
    keep: int
    budget: int
    header_tokens: int
    params: SamplingParams
    progress: ProgressCallback | None


def _is_messages(prompt: Prompt) -> bool:
    return not isinstance(prompt, str) and bool(prompt) and isinstance(prompt[0], dict)


def _leading_system_messages(prompt: Prompt) -> list[Message]:
    if not _is_messages(prompt):
        return []
    system = []
    for message in prompt:
        if message.get("role") != "system":
            break
        system.append(message)
    return system


class _Stats:
    """Timing and counts of one request, turned into a Completion at the end."""

    def __init__(self, start: float, prompt_tokens: int, cached: int, processed: int):
        self.start = start
        self.prompt_tokens = prompt_tokens
        self.cached = cached
        self.processed = processed
        self.first_token_at: float | None = None
        self.num_sampled = 0
        self.tokens: list[int] = []
        self.text: list[str] = []

    def sampled(self) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.num_sampled += 1

    def completion(self, finish_reason: str) -> Completion:
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
        )
