"""Runner: load a model once, then generate with a prompt cache that survives between requests.

Owns: the request path (validate -> prefix lookup -> prefill the rest -> decode -> report),
serializing requests from several threads, and the memory log line after each generation.

Invariant, however a request ends (normal end, stop string, the caller leaving `stream()`
early, an exception in a callback, KeyboardInterrupt, `cancel()`): each prompt-cache entry's
token list equals what its caches hold, and the next request reuses exactly that. This holds
because every model call goes through `ModelCache.forward`, which is all or nothing.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import mlx.core as mx

from mlxkv.cache.batched import can_batch
from mlxkv.cache.building import make_cache
from mlxkv.cache.model_cache import ModelCache
from mlxkv.cache.pool import CacheEntry, salt_digest
from mlxkv.cache.report import MemoryReport
from mlxkv.config import CONTEXT_MEMORY_FRACTION, RunnerConfig, format_bytes
from mlxkv.decoding.batch import DecodeBatch
from mlxkv.decoding.drafts import DraftModel
from mlxkv.decoding.prefill import PrefillPlan, ProgressCallback
from mlxkv.decoding.speculative import check_mode
from mlxkv.engine.cache_setup import make_pool
from mlxkv.engine.context import (
    default_max_batch,
    default_max_context,
    kv_bytes_per_token,
    rope_rotations,
)
from mlxkv.engine.engine_thread import EngineThread, Interleaved, Relay
from mlxkv.engine.lockstep import Lockstep
from mlxkv.engine.places import Places
from mlxkv.engine.prompt import Prompt, PromptEncoder, Tools
from mlxkv.engine.request import Request, RequestBuilder, RequestOptions
from mlxkv.engine.request_run import Batching, run_request
from mlxkv.engine.results import Completion, CompletionStats, GenerationChunk
from mlxkv.errors import RunnerBusyError
from mlxkv.models.loading import LoadedModel, load_model
from mlxkv.models.sharding import world
from mlxkv.platform.machine import memory_bytes
from mlxkv.platform.random_state import request_random_state, with_own_key

logger = logging.getLogger(__name__)

T = TypeVar("T")

# The warm-up's prefill chunk and draft verification widths (tokens).
_WARMUP_CHUNK_TOKENS = 32
_WARMUP_DRAFT_TOKENS = 4


class Runner:
    """A loaded model plus its prompt cache.

    Every method may be called from any thread. Generations run one at a time, in the order
    their turn comes; `cache_info`, `tokenizer`, `encode` and `cancel` never wait for one.

    Args:
        loaded: the model and tokenizer (see `Runner.load`).
        config: the settings (`mlxkv.config.RunnerConfig`: context window, prefill, prompt
            cache entries and budgets, disk tier, speculative decoding); None for defaults.
        draft: a loaded draft model for speculative decoding (same tokenizer); None loads
            `config.draft_model` if set.
        group: the process group `loaded` is sharded over (`Runner.load` finds it when
            started by `mlx.launch`); rank 0 serves requests, the others call `follow`.
        **options: `RunnerConfig` fields replacing those of `config` (`max_context=4096`).

    Raises:
        ValueError: an unknown setting, or one of the wrong type or out of range.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        config: RunnerConfig | None = None,
        *,
        draft: LoadedModel | None = None,
        group: mx.distributed.Group | None = None,
        **options: Any,
    ):
        config = RunnerConfig.of(config, options)
        if draft is None and config.draft_model is not None:
            draft = load_model(config.draft_model)
        self._lockstep = None if group is None else Lockstep(group)
        self.speculative = check_mode(config.speculative, has_draft_model=draft is not None)
        self.loaded = loaded
        self._prompts = PromptEncoder(loaded.tokenizer, loaded.vocab_size)
        config = self._fit_window(config, loaded)
        if self._lockstep is not None:  # every rank takes rank 0's cache settings
            config = self._lockstep.leaders_settings(config)
        self.config = config
        self.max_context = config.max_context
        self.prefill_plan = PrefillPlan.make(
            config.prefill_step_size, config.prefill_lanes, window_tokens=self.max_context
        )
        self._rotations = rope_rotations(loaded.model)
        self._draft = DraftModel.check(draft, loaded)
        self._pool = make_pool(loaded, self._make_entry, config)
        if self._pool.store is not None:  # a Runner dropped without close() stops its writer
            weakref.finalize(self, self._pool.store.close)
        # Every model call runs on this thread (see engine_thread); it ends with the Runner.
        self._engine = EngineThread(f"mlxkv-engine-{id(self):x}")
        weakref.finalize(self, self._engine.stop, False)
        if config.warmup:
            self._engine.call(self._warm_up)
        self._consumers: dict[int, Relay | Interleaved] = {}  # threads iterating a stream()
        self.max_batch = config.max_batch or default_max_batch(
            self.max_context, self._per_token_bytes, memory_bytes()
        )
        self._places = Places(self.max_batch)
        batch = DecodeBatch(loaded.model, self.max_batch)
        self._batching = Batching(batch, self._crowded)
        self._pool.working_bytes = lambda: batch.nbytes
        if self.max_batch > 1 and not can_batch(self._make_entry()):
            logger.info(
                "this model's cache layers (%s) do not batch: batched streams take turns, "
                "decoding one at a time",
                ", ".join(sorted({type(layer).__name__ for layer in self._make_entry()})),
            )
        self._builder = RequestBuilder(self._prompts, self.max_context, config.keep)
        self._requests: weakref.WeakSet[threading.Event] = weakref.WeakSet()
        self._requests_lock = threading.Lock()
        # The memory line logged after the last generation (sharded: with the ranks' sum).
        self.memory_line = ""

    def _fit_window(self, config: RunnerConfig, loaded: LoadedModel) -> RunnerConfig:
        """`config` with its context window: by default the model's maximum capped to what
        the entries' budget holds (`cache_bytes`, else a share of memory), one reading for
        both. A window the budget cannot hold is allowed, with a warning: a conversation
        longer than the budget keeps only its first part in the cache after each request."""
        per_token = kv_bytes_per_token(loaded.model, self._make_layers(config))
        self._per_token_bytes = per_token
        budget = config.cache_bytes or int(memory_bytes() * CONTEXT_MEMORY_FRACTION)
        window = config.max_context or default_max_context(
            loaded.max_position_embeddings, per_token, budget
        )
        if config.cache_bytes is not None and window * per_token > config.cache_bytes:
            logger.warning(
                "the context window (%d tokens) needs %s of K/V but cache_bytes is %s: a "
                "conversation keeps only its first %d tokens in the cache between requests "
                "(raise cache_bytes or lower max_context)",
                window,
                format_bytes(window * per_token),
                format_bytes(config.cache_bytes),
                config.cache_bytes // per_token,
            )
        return config.replace(max_context=window)

    def _warm_up(self) -> None:
        """One forward pass per shape class a request meets (a prefill chunk, a draft's
        verification, a decode step) on a scratch cache, for the model and the draft model:
        MLX compiles kernels for new shapes (9.8 s for the first request on an H100), here
        instead of in the first user's request. Touches no entry."""
        start = time.perf_counter()
        models = [(self.loaded.model, self._make_layers(self.config))]
        if self._draft is not None:
            models.append((self._draft.loaded.model, self._draft.make_cache()))
        chunk = min(_WARMUP_CHUNK_TOKENS, self.max_context - _WARMUP_DRAFT_TOKENS - 1)
        for model, cache in models:
            for width in (chunk, _WARMUP_DRAFT_TOKENS, 1):
                if width > 0:
                    mx.eval(mx.argmax(cache.forward(model, [0] * width)[:, -1, :], axis=-1))
        logger.info("warm-up: %.2f s", time.perf_counter() - start)

    @classmethod
    def load(
        cls,
        path_or_repo: str | Path | None = None,
        config: RunnerConfig | None = None,
        *,
        progress: ProgressCallback | None = None,
        **options: Any,
    ) -> Runner:
        """Loads a model and wraps it in a Runner.

        Args:
            path_or_repo: a Hugging Face-layout directory, a .gguf file, an Ollama model name,
                a Hugging Face repo id, or None for the bundled default (SmolLM2-135M-Instruct).
            config: the Runner's settings (`RunnerConfig`); None for defaults.
            progress: called as progress(done, total) in tensors while a GGUF file converts.
            **options: `RunnerConfig` fields replacing those of `config`.

        Started by `mlx.launch` with several processes, each process loads its shard of the
        model (see `mlxkv.models.sharding`); rank 0 then serves requests and the other ranks
        call `follow()`.

        Raises:
            ModelLoadError: nothing loadable at `path_or_repo` (the message says what was tried).
            ValueError: an unknown setting, or one of the wrong type or out of range.
        """
        config = RunnerConfig.of(config, options)  # checked before the slow part
        group = world()
        loaded = load_model(path_or_repo, progress=progress, group=group)
        return cls(loaded, config, group=group)

    def _make_layers(self, config: RunnerConfig) -> ModelCache:
        return make_cache(
            self.loaded.model, kv_bits=config.kv_bits, kv_group_size=config.kv_group_size
        )

    def _make_entry(self) -> ModelCache:
        cache = self._make_layers(self.config)
        cache.capacity_tokens = self.max_context  # the window is enforced by the cache too
        return cache

    @property
    def cache_dir(self) -> Path | None:
        """The disk tier's directory for this model (None: no disk tier)."""
        store = self._pool.store
        return None if store is None else store.directory

    @property
    def health(self) -> str | None:
        """None while the Runner can serve; else why it cannot (the ranks of a sharded
        Runner out of step: every request fails until every rank is restarted)."""
        return None if self._lockstep is None else self._lockstep.failure

    @property
    def rank(self) -> int:
        """This process's rank when the model is sharded (`mlx.launch`), else 0."""
        return 0 if self._lockstep is None else self._lockstep.rank

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    def encode(
        self,
        prompt: Prompt,
        *,
        parse_control_tokens: bool = False,
        tools: Tools | None = None,
        switches: dict[str, Any] | None = None,
    ) -> list[int]:
        """The token ids a prompt becomes (chat messages, tools and template `switches`
        through the chat template, with control-token text inside message content kept as
        text unless `parse_control_tokens`)."""
        return self._prompts.encode(
            prompt, parse_control_tokens=parse_control_tokens, tools=tools, switches=switches
        )

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
        overflow: str = "shift",
        grammar: str | None = None,
        cache_salt: str | None = None,
        switches: dict[str, Any] | None = None,
        batched: bool = False,
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
            overflow: when the prompt (as given) plus `max_tokens` is over `max_context`:
                "shift" drops early tokens mid-reply to go on, "stop" ends the reply with
                "length" when the window is full, "refuse" raises ContextLengthError first
                (the server's choices: a client's history is the client's to cut).
            grammar: an llguidance grammar the output keeps to, token by token (from a JSON
                schema: `mlxkv.json_schema_grammar(schema)`); turns speculative decoding off
                for this request. The output parses unless `max_tokens` cuts it.
            cache_salt: entries (and disk files) are reused only by requests with the same
                salt (None: the shared ones). Isolates clients from each other: without it,
                `cached_tokens` and timing tell one client what another's prompts began with.
            switches: chat-template variables such as `enable_thinking` (Qwen3's thinking
                switch) or `reasoning_effort`, passed only where the template reads them.
            cache_key: a label for the cache entry this request generates into, e.g. a
                conversation id; `cache_info()` shows it. Lookup is by tokens alone.
            batched: run interleaved with the other batched streams of this Runner (the
                server's way): their prefills take turns chunk by chunk, and their decoding
                runs as one batch, one forward pass per token for all (up to `max_batch`
                streams; more wait for a place). Not batched: one request at a time, in turn.
                A batched stream decodes alone (taking turns) while no other request runs
                (speculatively, as set), when seeded (on its own random key), and where the
                model's cache layers do not batch (sliding windows, recurrent state,
                quantized K/V). Greedy output equals the serial one's up to the batched
                kernels' rounding.
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
                `max_context`; or the prompt does not fit and `truncate` is False; or with
                `overflow="refuse"`, the prompt and `max_tokens` do not fit together.
            RunnerBusyError (when iterated): this thread is still inside another `stream()`.
            NotSupportedError: called on a rank other than 0 of a sharded Runner.
            RanksOutOfStepError: a sharded Runner's ranks stopped answering each other.
        """
        if self._lockstep is not None:
            self._lockstep.check_can_lead()
        if speculative == "default":
            speculative = self.speculative
        options = RequestOptions(
            progress, parse_control_tokens, tools, cancel, logprobs, truncate, cache_key,
            check_mode(speculative, has_draft_model=self._draft is not None), overflow, grammar,
            salt_digest(cache_salt), switches,
        )  # fmt: skip
        # Fitted to what the cache held after the last request (a cut the cache holds is
        # reused); another request running meanwhile costs only reuse, never correctness.
        request = self._builder.build(
            prompt,
            sampling,
            options,
            cached_prefix=functools.partial(self._pool.longest_prefix, salt=options.cache_salt),
            cut_starts=self._pool.cut_starts(options.cache_salt),
        )
        if self._lockstep is not None:  # ranks decide on a cancel and a seed together
            request = self._lockstep.prepare(request)
        with self._requests_lock:
            self._requests.add(request.cancelled)
        if batched and self._lockstep is None:
            return self._consume_interleaved(request)
        return self._consume(request)

    def _consume(self, request: Request) -> Iterator[GenerationChunk]:
        """The caller's side of a request: its chunks, computed on the engine thread."""
        try:
            yield from self._relay(lambda: self._serve(request))
        finally:
            with self._requests_lock:
                self._requests.discard(request.cancelled)

    def _consume_interleaved(self, request: Request) -> Iterator[GenerationChunk]:
        """A batched stream's side: waits for one of `max_batch` places, then its chunks."""
        try:
            self._refuse_second_stream()
            if not self._places.acquire(request.cancelled):
                stats = CompletionStats(time.perf_counter(), len(request.tokens), 0)
                yield stats.final_chunk("", "cancelled")
                return
            try:
                yield from self._relay(lambda: self._serve_interleaved(request), interleaved=True)
            finally:
                self._places.release()
        finally:
            with self._requests_lock:
                self._requests.discard(request.cancelled)

    def _refuse_second_stream(self) -> None:
        """Raises RunnerBusyError on a thread still reading a stream of this Runner: its new
        one would wait on the first (for the engine, or for a place), which only this thread
        can finish."""
        if threading.get_ident() in self._consumers:
            raise RunnerBusyError(
                "this thread is still iterating another stream() of this Runner; "
                "finish it or close() it before starting a new generation (waiting "
                "would never end)"
            )

    def _relay(self, make: Callable[[], Iterator[T]], *, interleaved: bool = False) -> Iterator[T]:
        """The items of the generator `make()` returns, run on the engine thread for this
        thread. A second one on a thread still reading one would wait on the first, which
        only this thread can finish: refused before it is queued. Meanwhile this thread's
        `cache_tokens` reads go through the relay (the engine is busy with its generator)."""
        me = threading.get_ident()
        with self._requests_lock:
            self._refuse_second_stream()
            engine = self._engine
            relay = engine.interleave(make) if interleaved else engine.iterate(make)
            self._consumers[me] = relay
        try:
            yield from relay
        finally:
            with self._requests_lock:
                del self._consumers[me]

    def _serve(self, request: Request) -> Iterator[GenerationChunk]:
        """One request on the engine thread, start to end, alone."""
        mx.reset_peak_memory()
        entries: list[CacheEntry] = []
        try:
            with request_random_state(request.params.seed):
                if self._lockstep is None:
                    chunks = self._run(request, entries.append)
                else:
                    chunks = self._lockstep.run(request, lambda r: self._run(r, entries.append))
                try:
                    for chunk in chunks:
                        if chunk is not None:  # a pause between prefill chunks: none here
                            yield chunk
                finally:
                    chunks.close()
        finally:
            self._end_request(entries[0] if entries else None)

    def _serve_interleaved(self, request: Request) -> Iterator[GenerationChunk | None]:
        """One request on the engine thread, taking turns with the other interleaved ones
        (each item is one engine job; None pauses)."""
        entries: list[CacheEntry] = []
        chunks = self._run(request, entries.append, self._batching)
        if request.params.seed is not None:
            chunks = with_own_key(chunks, request.params.seed)
        try:
            yield from chunks
        finally:
            chunks.close()
            self._end_request(entries[0] if entries else None)

    def _crowded(self) -> bool:
        """True while another batched stream runs or waits for its turn."""
        return self._places.taken > 1

    def _end_request(self, entry: CacheEntry | None) -> None:
        """Leaves nothing lazy behind (the disk tier and other threads read the entry);
        evicts to the cache's budget; logs the memory line."""
        try:
            if entry is not None:
                entry.cache.materialize()
                if entry.draft_cache is not None:
                    entry.draft_cache.materialize()
        except RuntimeError as error:  # a failed lazy computation: never keep a broken entry
            logger.warning("prompt cache dropped: its arrays could not be evaluated (%s)", error)
            entry.cache.free()
            entry.draft_cache = None
        if entry is not None:
            self._pool.release(entry)
        self._log_memory()

    def _run(
        self,
        request: Request,
        on_entry: Callable[[CacheEntry], None],
        batching: Batching | None = None,
    ) -> Iterator[GenerationChunk | None]:
        return run_request(
            request, self.loaded, self._pool, draft=self._draft, max_context=self.max_context,
            rotations=self._rotations, plan=self.prefill_plan, on_entry=on_entry,
            batching=batching,
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

    def cached_prefix_tokens(self, tokens: list[int], cache_salt: str | None = None) -> int:
        """How many leading tokens of `tokens` an in-memory cache entry of `cache_salt` holds
        now (the disk tier not counted); never waits. What a request for them would reuse,
        give or take the last token (always fed) and layers that cannot go back that far."""
        return self._pool.longest_prefix(tokens, salt=salt_digest(cache_salt))

    @property
    def cache_tokens(self) -> list[int]:
        """The token ids the entry of the last request holds (a copy). Waits for a generation
        running on another thread; inside this thread's own stream (whose generation waits
        for this thread meanwhile) it reads the cache as it is."""
        relay = self._consumers.get(threading.get_ident())
        if relay is not None:
            return relay.call(self._current_tokens)
        return self._engine.call(self._current_tokens)

    def _current_tokens(self) -> list[int]:
        entry = self._pool.current
        return [] if entry is None else entry.cache.tokens

    def reset(self) -> None:
        """Drops the prompt-cache entry and its memory (waits for a running generation).

        Raises:
            RunnerBusyError: called from inside this thread's own unfinished `stream()`.
        """
        if threading.get_ident() in self._consumers:
            raise RunnerBusyError("cannot reset the cache inside its own stream(); close it first")
        self._engine.call(self._reset_now)

    def _reset_now(self) -> None:
        if self._lockstep is not None and self._lockstep.leads:
            self._lockstep.announce("reset")
        self._pool.clear()

    def close(self, save_timeout_s: float | None = None) -> None:
        """Writes the entries to the disk tier (when there is one) and waits for every write,
        so a new Runner on the same `cache_dir` starts warm; with `save_timeout_s`, no entry
        starts writing after that many seconds (the most recently used go first). The Runner
        stays usable, except when sharded: rank 0's close ends the other ranks' `follow()`.

        Raises:
            RunnerBusyError: called from inside this thread's own unfinished `stream()`.
        """
        if threading.get_ident() in self._consumers:
            raise RunnerBusyError(
                "cannot close the Runner inside its own stream(); finish it first"
            )
        self._engine.call(self._close_now, save_timeout_s)

    def _close_now(self, save_timeout_s: float | None = None) -> None:
        if self._lockstep is not None and self._lockstep.leads:
            self._lockstep.announce("stop")
        self._pool.persist(save_timeout_s)
        if self._pool.store is not None:
            self._pool.store.close()

    def follow(self) -> Iterator[Completion]:
        """On ranks other than 0 of a sharded Runner: runs rank 0's requests and resets in
        step with it, yielding each request's Completion, until rank 0 closes its Runner.

        Raises:
            ValueError: this Runner is not sharded, or is rank 0.
        """
        if self._lockstep is None or self._lockstep.leads:
            raise ValueError("follow() is for ranks other than 0 of a Runner under mlx.launch")
        return self._relay(lambda: self._lockstep.follow(self._serve, self._reset_now))

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _log_memory(self) -> None:
        report = MemoryReport.measure(self._pool)
        ranks = "" if self._lockstep is None else self._lockstep.ranks_line(report)
        self.memory_line = report.log_line() + ranks
        logger.info("%s", self.memory_line)
