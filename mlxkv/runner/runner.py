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
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxkv.cache.model_cache import make_cache
from mlxkv.cache.prefix import PrefixCache
from mlxkv.errors import ContextLengthError
from mlxkv.runner.generate import (
    Completion,
    GenerationChunk,
    ProgressCallback,
    StopStrings,
    TokenPicker,
    decode_tokens,
    prefill,
)
from mlxkv.runner.loading import LoadedModel, load_model
from mlxkv.runner.memory import MemoryReport, format_bytes
from mlxkv.runner.prompt import Prompt, encode_prompt
from mlxkv.runner.sampling import SamplingParams

logger = logging.getLogger(__name__)


class Runner:
    """A loaded model plus its prompt cache.

    Args:
        loaded: the model and tokenizer (see `Runner.load`).
        max_context: most tokens (prompt + generated) one conversation may hold; None uses the
            model's `max_position_embeddings` (unbounded if the config has none).
        kv_bits: quantize global-attention K/V to 8 or 4 bits; None keeps the model's dtype.
        kv_group_size: head-dimension elements per quantization scale.
        prefill_step_size: most prompt tokens fed per model call; bounds prefill memory.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        max_context: int | None = None,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        prefill_step_size: int = 512,
    ):
        if max_context is not None and max_context < 2:
            raise ValueError(f"max_context must be at least 2 tokens, got {max_context}")
        if prefill_step_size < 1:
            raise ValueError(f"prefill_step_size must be >= 1 token, got {prefill_step_size}")
        self.loaded = loaded
        self.max_context = max_context or loaded.max_position_embeddings
        self.prefill_step_size = prefill_step_size
        cache = make_cache(loaded.model, kv_bits=kv_bits, kv_group_size=kv_group_size)
        self._prefix = PrefixCache(cache)
        self._lock = threading.Lock()
        self._cancel = threading.Event()

    @classmethod
    def load(
        cls,
        path_or_repo: str | Path,
        *,
        max_context: int | None = None,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        prefill_step_size: int = 512,
    ) -> Runner:
        """Loads a model (local directory or Hugging Face repo id) and wraps it in a Runner.

        Raises:
            ModelLoadError: nothing loadable at `path_or_repo` (the message says what was tried).
            ValueError: invalid cache or context settings.
        """
        return cls(
            load_model(path_or_repo),
            max_context=max_context,
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
            ContextLengthError: the prompt does not fit in `max_context`.
        """
        params = SamplingParams(**sampling)
        tokens = self.encode(prompt)
        if self.max_context is not None and len(tokens) > self.max_context:
            raise ContextLengthError(
                f"prompt is {len(tokens):,} tokens; context limit is {self.max_context:,} "
                "tokens. Shorten the prompt or raise max_context"
            )
        return self._stream(tokens, params, progress)

    def _stream(
        self, tokens: list[int], params: SamplingParams, progress: ProgressCallback | None
    ) -> Iterator[GenerationChunk]:
        with self._lock:
            self._cancel.clear()
            mx.reset_peak_memory()
            try:
                yield from self._run(tokens, params, progress)
            finally:
                self._prefix.entry.materialize()
                self._log_memory()

    def _run(
        self, tokens: list[int], params: SamplingParams, progress: ProgressCallback | None
    ) -> Iterator[GenerationChunk]:
        start = time.perf_counter()
        if params.seed is not None:
            mx.random.seed(params.seed)
        hit = self._prefix.fetch_nearest(tokens)
        model, tokenizer = self.loaded.model, self.loaded.tokenizer
        step = min(self.prefill_step_size, self.max_context or self.prefill_step_size)
        logits = prefill(model, hit.cache, hit.remaining, step_tokens=step, progress=progress)
        room = params.max_tokens
        if self.max_context is not None:
            room = min(room, self.max_context - len(tokens))
        pick = TokenPicker(params.make_sampler(), params.make_logits_processors(), tokens)
        stats = _Stats(start, len(tokens), hit.num_cached, len(hit.remaining))
        stops = StopStrings(params.stop)
        detokenizer = tokenizer.detokenizer
        detokenizer.reset()
        finish, cut_by_stop_string = "length", False
        for token in decode_tokens(model, hit.cache, logits, pick, room):
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
        report = MemoryReport.measure(self._prefix.entry)
        logger.info(
            "kv cache: %d tokens, %s in use, %s allocated, peak %s",
            report.num_tokens,
            format_bytes(report.used_bytes),
            format_bytes(report.allocated_bytes),
            format_bytes(report.peak_bytes),
        )


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
