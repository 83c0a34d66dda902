"""Runner: load a model once, then generate with a prompt cache that survives between requests.

Owns: loading, the settings a Runner fits to its model (context window, batch size), the
warm-up, and the public API: building each request (validated before anything changes) and
handing it to the dispatcher (`dispatch`), which runs it on the engine thread.

Invariant, however a request ends (normal end, stop string, the caller leaving `stream()`
early, an exception in a callback, KeyboardInterrupt, `cancel()`): each prompt-cache entry's
token list equals what its caches hold, and the next request reuses exactly that. This holds
because every model call goes through `ModelCache.forward`, which is all or nothing.
"""
# long: the library's entry point: each option of `stream` is documented where it is taken

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxkv.cache.model_cache import ModelCache
from mlxkv.config import RunnerConfig, check_speculative
from mlxkv.decoding.drafts import DraftModel
from mlxkv.decoding.prefill.chunks import PrefillPlan, ProgressCallback
from mlxkv.errors import NotSupportedError, RunnerBusyError
from mlxkv.models.embedding import Embedder, EmbeddingInput, Embeddings
from mlxkv.models.loading import LoadedModel, load_model
from mlxkv.models.rope import rope_rotations
from mlxkv.models.sharding import world
from mlxkv.runner.assembly import choose_max_batch, make_layers, make_pool, size_window, warm_up
from mlxkv.runner.prompt_cache.entry import token_array
from mlxkv.runner.prompt_cache.report import MemoryReport
from mlxkv.runner.request import RequestOptions
from mlxkv.runner.request_builder import RequestBuilder, salt_digest
from mlxkv.runner.results import Completion, GenerationChunk, PromptUsage
from mlxkv.runner.scheduling.dispatch import Dispatcher
from mlxkv.runner.scheduling.engine import EngineThread
from mlxkv.runner.scheduling.lockstep import Lockstep, Solo
from mlxkv.runner.text.messages import Tools
from mlxkv.runner.text.prompt import Prompt, PromptEncoder
from mlxkv.runner.text.replies import ReplyKey
from mlxkv.runner.text.vision import VisionPrompts

logger = logging.getLogger(__name__)


class Runner:
    """A loaded model plus its prompt cache.

    Every method may be called from any thread. A plain stream runs alone, in the order its
    turn comes; batched streams (`batched=True`, the server's) decode together. `cache_info`,
    `tokenizer`, `encode` and `cancel` never wait for one.

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
        # Every model call runs on this thread (see `engine`); it ends with the Runner.
        self._engine = EngineThread(f"mlxkv-engine-{id(self):x}")
        weakref.finalize(self, self._engine.stop, False)
        self._lockstep = Solo() if group is None else Lockstep(group, self._engine)
        self.speculative = check_speculative(config.speculative, has_draft_model=draft is not None)
        self.loaded = loaded
        self._prompts = PromptEncoder(loaded.tokenizer, loaded.vocab_size)
        config, snaps = size_window(loaded, config, self._engine, self._lockstep)
        self.config = config
        self.max_context = config.max_context
        self.prefill_plan = PrefillPlan.make(
            config.prefill_step_size, config.prefill_lanes, window_tokens=self.max_context
        )
        self._draft = DraftModel.check(draft, loaded)
        self._pool = make_pool(loaded, self._make_entry, config, snaps, self._engine)
        if self._pool.store is not None:  # a Runner dropped without close() stops its writer
            weakref.finalize(self, self._pool.store.close, False)
        self.max_batch = choose_max_batch(loaded, config, snaps, self._engine, self._lockstep)
        if config.warmup:
            # sharded, requests never batch (`dispatch`), and ranks may size batches apart
            batch_rows = 1 if self._lockstep.sharded else self.max_batch
            self._engine.call(warm_up, loaded, self._draft, config, batch_rows)
        self._dispatch = Dispatcher(
            loaded,
            self._pool,
            self._engine,
            config,
            draft=self._draft,
            rotations=rope_rotations(loaded.model),
            prefill_plan=self.prefill_plan,
            lockstep=self._lockstep,
            max_batch=self.max_batch,
        )
        vision = VisionPrompts(self._prompts.chat, loaded.vision, loaded.name)
        stored_reply = None if self._pool.store is None else self._pool.store.stored_reply
        self._builder = RequestBuilder(
            self._prompts, self.max_context, config.keep, vision, stored_reply
        )
        self._embedder = Embedder(
            loaded,
            self._prompts.encode,
            self._engine.call,
            max_tokens=self.max_context,
            batch_tokens=self.prefill_plan.step_tokens,
            name=loaded.name,
        )

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

    def _make_entry(self) -> ModelCache:
        cache = make_layers(self.loaded.model, self.config)
        cache.capacity_tokens = self.max_context  # the window is enforced by the cache too
        return cache

    @property
    def cache_dir(self) -> Path | None:
        """The disk tier's directory for this model (None: no disk tier)."""
        return None if self._pool.store is None else self._pool.store.directory

    @property
    def health(self) -> str | None:
        """None while the Runner can serve; else why it cannot (the ranks of a sharded
        Runner out of step: every request fails until every rank is restarted)."""
        return self._lockstep.failure

    def wait_unhealthy(self, timeout_s: float | None = None) -> str | None:
        """Waits until `health` is set, at most `timeout_s` seconds (None: without end; a
        Runner that is not sharded never falls out of step), and returns it: a server
        waits for it to stop, since the ranks cannot recover."""
        self._lockstep.failed.wait(timeout_s)
        return self.health

    @property
    def rank(self) -> int:
        """This process's rank when the model is sharded (`mlx.launch`), else 0."""
        return self._lockstep.rank

    @property
    def memory_line(self) -> str:
        """The memory line logged after the last generation (sharded: with the ranks' sum)."""
        return self._dispatch.memory_line

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
        cache_salt: str | None = None,
    ) -> list[int]:
        """The token ids a prompt becomes (chat messages, tools and template `switches`
        through the chat template, control-token text in content and tool calls kept as text
        unless `parse_control_tokens`, and an assistant message that is a reply generated
        here, with `cache_salt`, as the ids the model generated: `mlxkv.runner.text.replies`);
        an image's tokens carry its placeholder id (`mlxkv.models.vision`)."""
        return self._builder.encode(
            prompt,
            parse_control_tokens=parse_control_tokens,
            tools=tools,
            switches=switches,
            salt=salt_digest(cache_salt),
        )

    def generate(self, prompt: Prompt, **options: Any) -> Completion:
        """Generates a whole completion: `stream`'s arguments, and its errors."""
        return list(self.stream(prompt, **options))[-1].completion

    # long: the public API's one place documenting every option; the code is 20 lines
    def stream(
        self,
        prompt: Prompt,
        *,
        progress: ProgressCallback | None = None,
        matched: Callable[[PromptUsage], None] | None = None,
        parse_control_tokens: bool = False,
        tools: Tools | None = None,
        cancel: threading.Event | None = None,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        truncate: bool = True,
        cache_key: str | None = None,
        evict_first: bool = False,
        speculative: str | None = "default",
        overflow: str = "shift",
        grammar: str | None = None,
        cache_salt: str | None = None,
        switches: dict[str, Any] | None = None,
        batched: bool = False,
        reply_key: ReplyKey | None = None,
        **sampling: Any,
    ) -> Iterator[GenerationChunk]:
        """Streams a completion chunk by chunk.

        Args:
            prompt: a string (taken as already rendered), token ids, or chat messages
                ([{"role": ..., "content": ...}]).
            progress: called as progress(done, total) in prompt tokens during prefill.
            matched: called (on the engine thread) with the prompt's `PromptUsage` once the
                cache's match is final, before the prefill (a streamed disk restore: after
                its first chunk, every layer checked): what the completion's usage says too.
            parse_control_tokens: let control-token strings inside chat message content
                become control tokens; only for content you wrote yourself.
            tools: function definitions ([{"type": "function", "function": {...}}]) given to
                the chat template with chat messages; the model's tool calls come back as
                text (`mlxkv.server` parses them).
            cancel: an Event that ends this request alone when set (as `cancel()` ends all).
            logprobs: None for none; else each chunk carries its token's log-probability and
                this many (0..20) most likely alternatives.
            prompt_logprobs: the same for each prompt token after the first, on the chunks
                with `prompt`; a cached prefix is fed again for them (K/V hold no logits).
            truncate: cut a prompt longer than `max_context` (chats at user turns, keeping
                the system prompt); False raises ContextLengthError instead.
            overflow: when the prompt (as given) plus `max_tokens` is over `max_context`:
                "shift" drops early tokens to feed the next (the last, never fed, may end
                one past the window), "stop" ends with "length" when prompt and reply fill
                it, "refuse" raises ContextLengthError first (the server's choices).
            grammar: an llguidance grammar the output keeps to, token by token (from a JSON
                schema: `mlxkv.json_schema_grammar(schema)`); turns speculative decoding off
                for this request. The output parses unless `max_tokens` cuts it.
            cache_salt: entries (and disk files) are reused only by requests with the same
                salt (None: the shared ones). Isolates clients from each other: without it,
                `cached_tokens` and timing tell one client what another's prompts began with.
            switches: chat-template variables such as `enable_thinking` (Qwen3's thinking
                switch) or `reasoning_effort`, passed only where the template reads them.
            cache_key: a label for the entry it generates into (a conversation id), shown by
                `cache_info()`; lookup is by tokens alone.
            evict_first: a request's later choice: its entry, a copy, goes first for room.
            batched: run interleaved with the other batched streams of this Runner (the
                server's way): prefills take turns chunk by chunk, decoding runs as one batch
                (up to `max_batch` streams; more wait for a slot); not batched: one request
                at a time. It decodes alone while no other request runs, when seeded, and
                where the cache's layers do not batch (docs/batching.md). Greedy output
                equals the serial one's up to the batched kernels' rounding.
            reply_key: what the reply is known by when sent back, None for its text (the
                server: a call reply by its calls, `text.replies.call_reply_key`), so that a
                reply sent back takes its ids, also after a restart (the disk tier's records).
            speculative: "auto" drafts tokens (from the draft model if one is loaded, else by
                looking the text's last tokens up in the prompt and output) only while the
                model accepts enough of them to pay; "ngram" and "draft" always draft that
                way; None or "off" decodes plainly; "default" takes the Runner's setting.
                Drafts are verified several per forward pass: greedy output is plain
                decoding's, token for token, and sampling keeps the model's distribution.
            **sampling: `SamplingParams` fields: max_tokens, temperature, top_p, top_k, min_p,
                the penalties (repetition, presence, frequency), logit_bias, seed, stop.

        Returns:
            An iterator of chunks; the last one has `finish_reason` and `completion`. Leaving
            the loop early is safe: the cache keeps what was fed.

        Raises:
            ValueError: bad prompt or sampling settings (raised here, before anything changes).
            ContextLengthError: `keep`, or the chat's last turn, leaves no room in
                `max_context`; or the prompt does not fit and `truncate` is False; or with
                `overflow="refuse"`, the prompt and `max_tokens` do not fit together.
            RunnerBusyError (when iterated): this thread is still inside another `stream()`.
            NotSupportedError: called on a rank other than 0 of a sharded Runner, or on an
                encoder embedding model (it embeds, it does not generate).
            RanksOutOfStepError: a sharded Runner's ranks stopped answering each other.
        """
        self._lockstep.check_can_lead()
        if self.loaded.is_encoder:
            raise self.loaded.model.cannot_generate()
        if speculative == "default":
            speculative = self.speculative
        mode = check_speculative(speculative, has_draft_model=self._draft is not None)
        options = RequestOptions(
            progress=progress,
            matched=matched,
            parse_control_tokens=parse_control_tokens,
            tools=tools,
            cancel=cancel,
            top_logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            truncate=truncate,
            cache_key=cache_key,
            evict_first=evict_first,
            drops_before=self._pool.deletions.count,  # a deletion after it frees its entry
            speculative=mode,
            overflow=overflow,
            grammar=grammar,
            cache_salt=cache_salt,
            switches=switches,
            reply_key=reply_key,
        )
        # Fitted to what the cache held after the last request (a cut the cache holds is
        # reused); another request running meanwhile costs only reuse, never correctness.
        request = self._builder.build(
            prompt,
            sampling,
            options,
            cached_prefix=self._pool.cuts.held_prefix,
            cut_starts=self._pool.cuts.starts,
        )
        request = self._lockstep.prepare(request)  # ranks agree on a cancel and a seed
        return self._dispatch.stream(request, batched=batched)

    def embed(
        self,
        texts: EmbeddingInput | Sequence[EmbeddingInput],
        *,
        dimensions: int | None = None,
        truncate: bool = False,
    ) -> Embeddings:
        """Embeds texts: one unit vector each, from the model's final hidden states pooled as
        `mlxkv.models.embedding` says; batched, between the steps of any generation running
        meanwhile; the prompt cache is neither read nor changed.

        Args:
            texts: a string, a list of strings, or token ids (a list, or a list of lists).
            dimensions: keep the first this many components, normalized again (for models
                trained for it, Matryoshka-style: Qwen3-Embedding, nomic); None keeps all.
            truncate: cut an input longer than `max_context` to its first `max_context`
                tokens; False raises ContextLengthError instead.

        Returns:
            `Embeddings`: float32 vectors (N, D) in the inputs' order, and the tokens counted.

        Raises:
            ValueError: an empty input, ids outside the vocabulary, or `dimensions` out of
                range (before any model work); ContextLengthError: an input over `max_context`
                and `truncate` False.
            NotSupportedError: the model exposes no hidden states (Mamba), or is sharded.
        """
        if self._lockstep.sharded:  # the other ranks would have to run the same forward passes
            raise NotSupportedError("embeddings from a model sharded over processes")
        return self._embedder.embed(texts, dimensions=dimensions, truncate=truncate)

    def cancel(self) -> None:
        """Ends every request already started (the one generating, and those waiting their
        turn) with finish_reason "cancelled": between prefill chunks or decode steps. The
        cache keeps every token fed so far. Requests started later are not affected."""
        self._dispatch.cancel()

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

    def stored_prefix_tokens(self, tokens: list[int], cache_salt: str | None = None) -> int:
        """How many leading tokens of `tokens` a disk-tier file of `cache_salt` holds (0 with
        no disk tier): what a request would load back rather than prefill, unless prefilling
        them is faster. Never waits, and never rescans the directory."""
        store, query, salt = self._pool.store, token_array(tokens), salt_digest(cache_salt)
        return 0 if store is None else store.best(query, len(tokens), salt, rescan=False)[1]

    @property
    def cache_tokens(self) -> list[int]:
        """The token ids the entry of the last request holds (a copy). Waits for a generation
        running on another thread; inside this thread's own stream (whose generation waits
        for this thread meanwhile) it reads the cache as it is."""
        return self._dispatch.call(self._current_tokens)

    def _current_tokens(self) -> list[int]:
        return [] if self._pool.latest is None else self._pool.latest.cache.tokens

    def reset(self) -> None:
        """Drops the prompt-cache entries and their memory (waits for a running generation;
        batched streams, which take turns, go on meanwhile on entries dropped when they end).

        Raises:
            RunnerBusyError: called from inside this thread's own unfinished `stream()`.
        """
        if self._dispatch.inside_stream:
            raise RunnerBusyError("cannot reset the cache inside its own stream(); close it first")
        self._engine.call(self._reset_now)

    def _reset_now(self) -> None:
        if self._lockstep.leads:
            self._lockstep.announce("reset")
        self._pool.clear()

    def drop_cache_entries(self, cache_key: str) -> int:
        """Frees from memory the prompt-cache entries whose last request gave `cache_key` (a
        conversation its client deleted) and returns how many; entries of a `cache_salt` are
        never dropped. The disk tier keeps its blocks (shared by content) until its budget
        evicts them. Waits as `reset` does (an entry in use goes when its request ends, as
        does one of a request made before the call and run after it).

        Raises:
            RunnerBusyError: called from inside this thread's own unfinished `stream()`.
        """
        if self._dispatch.inside_stream:
            raise RunnerBusyError("cannot drop entries inside its own stream(); close it first")
        return self._engine.call(lambda: self._drop_now(cache_key))

    def _drop_now(self, cache_key: str) -> int:
        if self._lockstep.leads:
            self._lockstep.announce("drop", cache_key=cache_key)
        dropped = self._pool.drop_labelled(cache_key)
        logger.info("prefix cache: dropped %d entries of %r", dropped, cache_key)
        return dropped

    def close(self, save_timeout_s: float | None = None) -> None:
        """Writes the entries to the disk tier (when there is one) and waits for every write,
        so a new Runner on the same `cache_dir` starts warm; with `save_timeout_s`, no entry
        starts writing after that many seconds (the most recently used go first). Batched
        streams running meanwhile go on; their entries are saved as they were when they
        joined the batch. The Runner stays usable, except when sharded: rank 0's close ends
        the other ranks' `follow()`; once the ranks are out of step (`health`), it returns
        at once.

        Raises:
            RunnerBusyError: called from inside this thread's own unfinished `stream()`.
        """
        if self._dispatch.inside_stream:
            raise RunnerBusyError(
                "cannot close the Runner inside its own stream(); finish it first"
            )
        if self.health is not None:  # sharded (no disk tier), no rank to tell: nothing to do
            return
        self._engine.call(self._close_now, save_timeout_s)

    def _close_now(self, save_timeout_s: float | None = None) -> None:
        if self._lockstep.leads:
            self._lockstep.announce("stop")
        self._pool.persist(save_timeout_s)
        if self._pool.store is not None:
            self._pool.store.close()

    def follow(self) -> Iterator[Completion]:
        """On ranks other than 0 of a sharded Runner: runs rank 0's requests, resets and
        dropped entries in step with it, yielding each request's Completion, until rank 0
        closes its Runner.

        Raises:
            ValueError: this Runner is not sharded, or is rank 0.
        """
        if self._lockstep.leads:
            raise ValueError("follow() is for ranks other than 0 of a Runner under mlx.launch")
        return self._dispatch.follow(self._reset_now, self._drop_now)

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
