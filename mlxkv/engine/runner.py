"""Runner: load a model once, then generate with a prompt cache that survives between requests.

Owns: the request path (validate -> prefix lookup -> prefill the rest -> decode -> report),
serializing requests from several threads, and the memory log line after each generation.

Invariant, however a request ends (normal end, stop string, the caller leaving `stream()`
early, an exception in a callback, KeyboardInterrupt, `cancel()`): each prompt-cache entry's
token list equals what its caches hold, and the next request reuses exactly that. This holds
because every model call goes through `ModelCache.forward`, which is all or nothing.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxkv.cache.model_cache import ModelCache, make_cache
from mlxkv.cache.report import MemoryReport
from mlxkv.config import CacheSettings
from mlxkv.decoding.drafts import DraftModel
from mlxkv.decoding.prefill import ProgressCallback
from mlxkv.decoding.speculative import check_mode
from mlxkv.engine.cache_setup import make_pool
from mlxkv.engine.context import default_max_context, rope_rotations
from mlxkv.engine.lockstep import Lockstep
from mlxkv.engine.prompt import Prompt, PromptEncoder, Tools
from mlxkv.engine.request import Request, RequestBuilder, RequestOptions
from mlxkv.engine.request_run import run_request
from mlxkv.engine.results import Completion, GenerationChunk
from mlxkv.errors import RunnerBusyError, check_int
from mlxkv.models.loading import LoadedModel, load_model
from mlxkv.models.sharding import world
from mlxkv.platform.random_state import clean_random_state
from mlxkv.platform.threads import release_streams_at_thread_exit

logger = logging.getLogger(__name__)


class Runner:
    """A loaded model plus its prompt cache.

    Every method may be called from any thread. Generations run one at a time, in the order
    their turn comes; `cache_info`, `tokenizer`, `encode` and `cancel` never wait for one.

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
        cache_entries: most prompt-cache entries (conversations) kept in memory; 1 keeps one
            entry and trims it in place. More keep a prefix tree of entries (see
            `mlxkv.cache.pool`): each conversation comes back to its own.
        cache_bytes: the entries' byte budget (int bytes, or "4GiB", "512MiB"), held after
            every request; None for no limit.
        cache_dir: a directory for the disk tier: evicted entries are written there and
            loaded back, and a new Runner on it (a restart) starts warm. None for none.
        cache_dir_bytes: the disk tier's byte budget (default 16 GiB).
        draft: a draft model for speculative decoding (same tokenizer); see `Runner.load`.
        speculative: the requests' default speculative decoding mode (see `stream`).
        group: the process group `loaded` is sharded over (`Runner.load` finds it when
            started by `mlx.launch`); rank 0 serves requests, the others call `follow`.

    Raises:
        ValueError: a setting of the wrong type or out of range.
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
        cache_entries: int = 1,
        cache_bytes: int | str | None = None,
        cache_dir: str | Path | None = None,
        cache_dir_bytes: int | str | None = None,
        draft: LoadedModel | None = None,
        speculative: str | None = "auto",
        group: mx.distributed.Group | None = None,
    ):
        settings = CacheSettings.check(cache_entries, cache_bytes, cache_dir, cache_dir_bytes)
        self._lockstep = None if group is None else Lockstep(group)
        self.speculative = check_mode(speculative, has_draft_model=draft is not None)
        if max_context is not None:
            check_int("max_context (tokens)", max_context, low=2)
        if keep is not None:
            check_int("keep (tokens)", keep, low=0)
        if kv_bits is not None:
            check_int("kv_bits", kv_bits, low=1)
        check_int("kv_group_size", kv_group_size, low=1)
        check_int("prefill_step_size (tokens)", prefill_step_size, low=1)
        self.loaded = loaded
        self.keep = keep
        self.prefill_step_size = prefill_step_size
        self._prompts = PromptEncoder(loaded.tokenizer, loaded.vocab_size)
        self._kv_settings = {"kv_bits": kv_bits, "kv_group_size": kv_group_size}
        probe = make_cache(loaded.model, **self._kv_settings)
        self.max_context = max_context or default_max_context(
            loaded.model, loaded.max_position_embeddings, probe
        )
        if self._lockstep is not None:  # every rank takes rank 0's cache settings
            self.max_context, settings = self._lockstep.leaders_settings(self.max_context, settings)
        self._rotations = rope_rotations(loaded.model)
        self._draft = DraftModel.check(draft, loaded)
        self._pool = make_pool(loaded, self._make_entry, settings)
        self._lock = threading.Lock()  # held for a whole generation
        self._owner: int | None = None  # the thread that holds it
        self._builder = RequestBuilder(self._prompts, self.max_context, keep)
        self._requests: weakref.WeakSet[threading.Event] = weakref.WeakSet()
        self._requests_lock = threading.Lock()
        # The memory line logged after the last generation (sharded: with the ranks' sum).
        self.memory_line = ""

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
        cache_entries: int = 1,
        cache_bytes: int | str | None = None,
        cache_dir: str | Path | None = None,
        cache_dir_bytes: int | str | None = None,
        draft_model: str | Path | None = None,
        speculative: str | None = "auto",
    ) -> Runner:
        """Loads a model and wraps it in a Runner (the other arguments are the Runner's).

        Args:
            path_or_repo: a Hugging Face-layout directory, a .gguf file, an Ollama model name,
                a Hugging Face repo id, or None for the bundled default (SmolLM2-135M-Instruct).
            draft_model: a small model with the same tokenizer for speculative decoding
                (any form `path_or_repo` takes); None for none.

        Started by `mlx.launch` with several processes, each process loads its shard of the
        model (see `mlxkv.models.sharding`); rank 0 then serves requests and the other
        ranks call `follow()`.

        Raises:
            ModelLoadError: nothing loadable at `path_or_repo` (the message says what was tried).
            ValueError: invalid cache or context settings.
        """
        group = world()
        return cls(
            load_model(path_or_repo, group=group),
            max_context=max_context,
            keep=keep,
            kv_bits=kv_bits,
            kv_group_size=kv_group_size,
            prefill_step_size=prefill_step_size,
            cache_entries=cache_entries,
            cache_bytes=cache_bytes,
            cache_dir=cache_dir,
            cache_dir_bytes=cache_dir_bytes,
            draft=None if draft_model is None else load_model(draft_model),
            speculative=speculative,
            group=group,
        )

    def _make_entry(self) -> ModelCache:
        cache = make_cache(self.loaded.model, **self._kv_settings)
        cache.capacity_tokens = self.max_context  # the window is enforced by the cache too
        return cache

    @property
    def cache_dir(self) -> Path | None:
        """The disk tier's directory for this model (None: no disk tier)."""
        store = self._pool.store
        return None if store is None else store.directory

    @property
    def rank(self) -> int:
        """This process's rank when the model is sharded (`mlx.launch`), else 0."""
        return 0 if self._lockstep is None else self._lockstep.rank

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    def encode(
        self, prompt: Prompt, *, parse_control_tokens: bool = False, tools: Tools | None = None
    ) -> list[int]:
        """The token ids a prompt becomes (chat messages and tools through the chat template,
        with control-token text inside message content kept as text unless
        `parse_control_tokens`)."""
        return self._prompts.encode(prompt, parse_control_tokens=parse_control_tokens, tools=tools)

    def generate(self, prompt: Prompt, **options: Any) -> Completion:
        """Generates a whole completion. Takes the same arguments as `stream` (and raises the
        same errors)."""
        return list(self.stream(prompt, **options))[-1].completion

    def stream(
        self,
        prompt: Prompt,
        *,
        progress: ProgressCallback | None = None,
        parse_control_tokens: bool = False,
        tools: Tools | None = None,
        cancel: threading.Event | None = None,
        logprobs: int | None = None,
        truncate: bool = True,
        cache_key: str | None = None,
        speculative: str | None = "default",
        **sampling: Any,
    ) -> Iterator[GenerationChunk]:
        """Streams a completion chunk by chunk.

        Args:
            prompt: a string (taken as already rendered), token ids, or chat messages
                ([{"role": ..., "content": ...}]).
            progress: called as progress(done, total) in prompt tokens during prefill.
            parse_control_tokens: let control-token strings inside chat message content
                become control tokens; only for content you wrote yourself.
            tools: function definitions ([{"type": "function", "function": {...}}]) given to
                the chat template with chat messages; the model's tool calls come back as
                text (`mlxkv.server` parses them).
            cancel: an Event that ends this request alone when set (as `cancel()` ends all).
            logprobs: None for none; else each chunk carries its token's log-probability and
                this many (0..20) most likely alternatives.
            truncate: cut a prompt longer than `max_context` (chats at user turns, keeping
                the system prompt); False raises ContextLengthError instead.
            cache_key: a label for the cache entry this request generates into, e.g. a
                conversation id; `cache_info()` shows it. Lookup is by tokens alone.
            speculative: "auto" drafts tokens (from the draft model if one is loaded, else by
                looking the text's last tokens up in the prompt and output) only while the
                model accepts enough of them to pay; "ngram" and "draft" always draft that
                way; None or "off" decodes plainly; "default" takes the Runner's setting.
                Drafts are verified several per forward pass: greedy output is plain
                decoding's, token for token, and sampling keeps the model's distribution.
            **sampling: `SamplingParams` fields: max_tokens, temperature, top_p, top_k, min_p,
                repetition_penalty, seed, stop.

        Returns:
            An iterator of chunks; the last one has `finish_reason` and `completion`. Leaving
            the loop early is safe: the cache keeps what was fed.

        Raises:
            ValueError: bad prompt or sampling settings (raised here, before anything changes).
            ContextLengthError: `keep`, or the chat's last turn, leaves no room in
                `max_context`; or the prompt does not fit and `truncate` is False.
            RunnerBusyError (when iterated): this thread is still inside another `stream()`.
        """
        if speculative == "default":
            speculative = self.speculative
        options = RequestOptions(
            progress, parse_control_tokens, tools, cancel, logprobs, truncate, cache_key,
            check_mode(speculative, has_draft_model=self._draft is not None),
        )  # fmt: skip
        # Fitted to what the cache held after the last request (a cut the cache holds is
        # reused); another request running meanwhile costs only reuse, never correctness.
        request = self._builder.build(
            prompt, sampling, options, cached_prefix=self._pool.longest_prefix
        )
        if self._lockstep is not None:  # ranks decide on a cancel together
            request = self._lockstep.with_agreed_cancel(request)
        with self._requests_lock:
            self._requests.add(request.cancelled)
        return self._stream(request)

    def _stream(self, request: Request) -> Iterator[GenerationChunk]:
        if self._owner == threading.get_ident():
            raise RunnerBusyError(
                "this thread is still iterating another stream() of this Runner; finish it or "
                "close() it before starting a new generation (waiting would never end)"
            )
        with self._lock:
            self._owner = threading.get_ident()
            mx.reset_peak_memory()
            try:
                with clean_random_state():
                    if self._lockstep is None:
                        yield from self._run(request)
                    else:
                        yield from self._lockstep.run(request, self._run)
            finally:
                self._owner = None
                with self._requests_lock:
                    self._requests.discard(request.cancelled)
                self._end_request()

    def _end_request(self) -> None:
        """Leaves nothing lazy or thread-bound behind, so the next request may run on any
        thread; evicts to the cache's budget; logs the memory line."""
        entry = self._pool.current
        try:
            if entry is not None:
                entry.cache.materialize()
        except RuntimeError as error:  # a failed lazy computation: never keep a broken entry
            logger.warning("prompt cache dropped: its arrays could not be evaluated (%s)", error)
            entry.cache.free()
        self._pool.release()
        release_streams_at_thread_exit()
        self._log_memory()

    def _run(self, request: Request) -> Iterator[GenerationChunk]:
        step = min(self.prefill_step_size, self.max_context)  # never more than the window
        return run_request(
            request, self.loaded, self._pool, draft=self._draft, max_context=self.max_context,
            rotations=self._rotations, step_tokens=step,
        )  # fmt: skip

    def cancel(self) -> None:
        """Ends every request already started (the one generating, and those waiting their
        turn) with finish_reason "cancelled": between prefill chunks or decode steps. The
        cache keeps every token fed so far. Requests started later are not affected."""
        with self._requests_lock:
            started = list(self._requests)
        for cancelled in started:
            cancelled.set()

    def cache_info(self) -> MemoryReport:
        """Tokens held by the prompt cache's entries, their bytes, and the disk tier. Never
        waits: during a generation on another thread it is a live reading of a cache that is
        changing."""
        return MemoryReport.measure(self._pool)

    @property
    def cache_tokens(self) -> list[int]:
        """The token ids the entry of the last request holds (a copy). Waits for a generation
        running on another thread; inside this thread's own stream it reads the cache as it
        is."""
        if self._owner == threading.get_ident():
            return self._current_tokens()
        with self._lock:
            return self._current_tokens()

    def _current_tokens(self) -> list[int]:
        entry = self._pool.current
        return [] if entry is None else entry.cache.tokens

    def reset(self) -> None:
        """Drops the prompt-cache entry and its memory (waits for a running generation).

        Raises:
            RunnerBusyError: called from inside this thread's own unfinished `stream()`.
        """
        if self._owner == threading.get_ident():
            raise RunnerBusyError("cannot reset the cache inside its own stream(); close it first")
        with self._lock:
            if self._lockstep is not None and self._lockstep.leads:
                self._lockstep.announce("reset")
            self._pool.clear()
            self._builder.forget_cut()

    def close(self) -> None:
        """Writes the entries to the disk tier (when there is one) and waits for every write,
        so a new Runner on the same `cache_dir` starts warm. The Runner stays usable, except
        when sharded: rank 0's close ends the other ranks' `follow()`."""
        with self._lock:
            if self._lockstep is not None and self._lockstep.leads:
                self._lockstep.announce("stop")
            self._pool.persist()

    def follow(self) -> Iterator[Completion]:
        """On ranks other than 0 of a sharded Runner: runs rank 0's requests and resets in
        step with it, yielding each request's Completion, until rank 0 closes its Runner.

        Raises:
            ValueError: this Runner is not sharded, or is rank 0.
        """
        if self._lockstep is None or self._lockstep.leads:
            raise ValueError("follow() is for ranks other than 0 of a Runner under mlx.launch")
        return self._lockstep.follow(self._stream, self.reset)

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _log_memory(self) -> None:
        report = MemoryReport.measure(self._pool)
        ranks = "" if self._lockstep is None else self._lockstep.ranks_line(report)
        self.memory_line = report.log_line() + ranks
        logger.info("%s", self.memory_line)
