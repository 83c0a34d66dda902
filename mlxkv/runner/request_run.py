"""One request's path through the model: prefix lookup, prefill of what the cache lacks,
decoding (plain, speculative or batched with other requests), and the text chunks the caller
streams.

Owns `run_request` and the choice of decoder. Does not own serializing or interleaving
requests, thread bookkeeping or the memory line (`runner`), nor the cache policy
(`mlxkv.runner.prompt_cache.pool`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import mlx.core as mx

from mlxkv.cache.kv import Rotation
from mlxkv.cache.model_cache import ModelCache
from mlxkv.decoding.batch import DecodeBatch, batched_tokens, joined_tokens
from mlxkv.decoding.drafts import DraftModel, NgramDrafter
from mlxkv.decoding.grammar import grammar_processor
from mlxkv.decoding.picker import TokenPicker
from mlxkv.decoding.plain import decode_tokens
from mlxkv.decoding.prefill import PrefillPlan, fill
from mlxkv.decoding.speculative import Drafter, DraftLength, speculative_tokens
from mlxkv.models.loading import LoadedModel
from mlxkv.models.vision import ImagePrompt
from mlxkv.runner.context import ContextWindow
from mlxkv.runner.prefill.fill import PrefillCancelled, fill_prompt
from mlxkv.runner.prefill.group import PrefillGroup
from mlxkv.runner.prompt_cache.pool import CacheEntry, CachePool, PrefixHit
from mlxkv.runner.request import Request
from mlxkv.runner.results import CompletionStats, GenerationChunk
from mlxkv.runner.text.chunks import emit_chunks


@dataclass
class Batching:
    """How interleaved requests decode together (read and changed on the engine thread only).

    Attributes:
        batch: the rows decoding together.
        prefills: the short prompts reaching their prefill at the same moment, fed together.
        streams: requests decoding now that can batch (not seeded, reply within the window),
            in the batch or, alone, speculatively.
    """

    batch: DecodeBatch
    prefills: PrefillGroup
    streams: int = 0

    @contextlib.contextmanager
    def counted(self) -> Iterator[None]:
        """Counts a request in `streams` while it decodes, however it ends."""
        self.streams += 1
        try:
            yield
        finally:
            self.streams -= 1

    def crowded(self) -> bool:
        """True while another request that can batch is decoding: a request alone decodes
        speculatively (which does not batch) until then, in the batch meanwhile."""
        return self.streams > 1


def run_request(
    request: Request,
    loaded: LoadedModel,
    pool: CachePool,
    *,
    draft: DraftModel | None,
    max_context: int,
    rotations: list[Rotation | None],
    plan: PrefillPlan,
    on_entry: Callable[[CacheEntry], None],
    batching: Batching | None = None,
) -> Iterator[GenerationChunk | None]:
    """Runs `request` on the pool's nearest entry, in place; yields its chunks, the last one
    with the Completion, and None for a pause where interleaved requests run (between prefill
    chunks, waiting for a shared prefix or for prompts prefilled together, joining the decode
    batch; a serial caller skips it). The caller ends the request (releases the entry).

    Args:
        max_context: the context window, in tokens (a generation that reaches it shifts).
        rotations: per layer, how to re-rotate keys when the context shifts (None: cannot).
        plan: how prompt tokens are fed (chunk size, CPU lanes).
        on_entry: told the entry the request generates into, as soon as it is chosen.
        batching: decode in a batch with other requests where possible, taking turns with
            them (first waiting for a prefix one of them is feeding); None: alone.
    """
    tokens = request.tokens
    stats_start = time.perf_counter()
    loaded, batching = _with_images(loaded, request, batching)
    if batching is not None:  # interleaved: other requests run between this one's turns
        with batching.prefills.arriving():
            yield from _await_shared_prefix(request, pool)
    if request.cancelled.is_set():  # cancelled while waiting its turn: touch nothing
        yield CompletionStats(stats_start, len(tokens), 0).final_chunk("", "cancelled")
        return
    hit, entry = _claim_entry(request, pool, on_entry)
    stats = CompletionStats(stats_start, len(tokens), hit.num_cached)
    start = time.perf_counter()
    model = loaded.model
    try:
        together = _prefilled_with(request, batching)
        logits = yield from fill_prompt(model, request, hit, stats, plan=plan, together=together)
    except PrefillCancelled:
        yield stats.final_chunk("", "cancelled")
        return
    if len(hit.remaining) >= plan.step_tokens:  # long enough to measure; weighs disk loads
        pool.prefill_tokens_per_s = len(hit.remaining) / (time.perf_counter() - start)
    window = ContextWindow(
        max_context, request.keep, rotations, refill=lambda c, ids: fill(model, c, ids, plan)
    )
    draft_cache = _draft_cache_for(entry, request, draft, max_context)
    batching = batching if _can_batch(request, hit.cache, max_context, batching) else None
    with batching.counted() if batching is not None else contextlib.nullcontext():
        decoded, pick = _decode(
            request, draft, draft_cache, loaded, hit.cache, logits, stats, plan,
            window.make_room, batching,
        )  # fmt: skip
        try:
            yield from emit_chunks(loaded.tokenizer, decoded, stats, request, pick)
        finally:  # here, on the engine thread, before the entry is released (even on error)
            decoded.close()


def _with_images(
    loaded: LoadedModel, request: Request, batching: Batching | None
) -> tuple[LoadedModel, Batching | None]:
    """For a vision model: `loaded` with its model bound to the request's images (the
    encoder's output over their placeholders, M-RoPE positions), and no batching (each call
    carries one prompt's positions). A text model's come back as they are."""
    if loaded.vision is None:
        return loaded, batching
    if not request.images:
        return loaded, None
    bound = ImagePrompt(loaded.model, loaded.vision, request.tokens, request.images)
    return dataclasses.replace(loaded, model=bound), None


def _prefilled_with(request: Request, batching: Batching | None) -> PrefillGroup | None:
    """The group the request's prompt may be prefilled with: none when not interleaved, nor
    for a seeded request, whose draws must be those it makes alone (from its prompt's logits
    fed alone, not a batched pass's, which round otherwise)."""
    if batching is None or request.params.seed is not None:
        return None
    return batching.prefills


def _await_shared_prefix(request: Request, pool: CachePool) -> Iterator[None]:
    """Pauses (yields None) while a request running now feeds a longer prefix of this one's
    prompt than the cache holds, so that this one copies it rather than feeding it again;
    ends at once when cancelled. Only between turns of interleaved requests: the one it
    waits for feeds meanwhile."""
    while not request.cancelled.is_set() and pool.awaits_prefix(request.tokens, request.cache_salt):
        yield None


def _claim_entry(
    request: Request, pool: CachePool, on_entry: Callable[[CacheEntry], None]
) -> tuple[PrefixHit, CacheEntry]:
    """The pool's nearest entry for the request (reused, copied or new), told to `on_entry`
    at once (whatever happens next, the caller releases it), marked with the request's
    labels."""
    tokens = request.tokens
    hit = pool.fetch_nearest(
        tokens,
        reply_start=len(tokens) - request.header_tokens,
        salt=request.cache_salt,
        keep=request.keep,
    )
    entry = pool.current
    on_entry(entry)
    entry.cut_start = request.cut_start
    if request.cache_key is not None:
        entry.label = request.cache_key
    return hit, entry


def _draft_cache_for(
    entry: CacheEntry, request: Request, draft: DraftModel | None, max_context: int
) -> ModelCache | None:
    """The entry's draft-model cache when the request drafts with the draft model (made on
    first use, bounded as the entry), else None."""
    if draft is None or request.speculative not in ("auto", "draft"):
        return None
    entry.draft_cache = entry.draft_cache or draft.make_cache()
    entry.draft_cache.capacity_tokens = max_context + DraftLength.MAX_TOKENS
    return entry.draft_cache


def _can_batch(
    request: Request, cache: ModelCache, max_context: int, batching: Batching | None
) -> bool:
    """Whether this request may decode in the batch (at once, or when others come): not a
    seeded one, which draws from its own random key that a batched step (sampling every row
    at once) would share, nor one whose reply may not fit the window (a batch cannot shift
    one row's context)."""
    if batching is None or request.params.seed is not None:
        return False
    if not batching.batch.accepts(cache):
        return False
    return len(request.tokens) + request.params.max_tokens <= max_context


def _decode(
    request: Request,
    draft_model: DraftModel | None,
    draft_cache: ModelCache | None,
    loaded: LoadedModel,
    cache: ModelCache,
    logits: mx.array,
    stats: CompletionStats,
    plan: PrefillPlan,
    make_room: Callable[[ModelCache, int], None] | None = None,
    batching: Batching | None = None,
) -> tuple[Iterator[int | None], TokenPicker]:
    """The generated token ids of one request, from the prompt's last logits, and the picker
    that samples them: `decode_tokens` when the request's mode is None, else
    `speculative_tokens` with the mode's drafter (see `MODES`). With `batching`: in the batch
    from the start when the mode is None or others are decoding already, else speculatively
    while alone and in the batch while others decode (`_alone_or_batched`)."""
    params, prompt = request.params, request.tokens
    sampling = params.make_sampling(loaded.vocab_size)
    processors = list(sampling.processors)
    if request.grammar is not None:
        processors.append(
            grammar_processor(request.grammar, loaded.tokenizer, loaded.vocab_size, len(prompt))
        )
    pick = TokenPicker(
        sampling.sampler, processors, prompt,
        top_logprobs=request.top_logprobs, greedy=sampling.distribution is None,
    )  # fmt: skip
    if batching is not None and (request.speculative is None or batching.crowded()):
        return batched_tokens(batching.batch, cache, logits, pick, params.max_tokens), pick
    if request.speculative is None:
        return decode_tokens(loaded.model, cache, logits, pick, params.max_tokens, make_room), pick
    if draft_cache is not None:
        drafter = draft_model.drafter(draft_cache, prompt, sampling.distribution, plan)
    else:
        drafter = NgramDrafter(prompt)
    length = DraftLength(gated=request.speculative == "auto")

    def speculate(after: int | None, max_tokens: int) -> Iterator[int]:
        return speculative_tokens(
            loaded.model,
            cache,
            logits,
            pick,
            max_tokens,
            drafter=drafter,
            length=length,
            distribution=sampling.distribution,
            counts=stats.drafts,
            make_room=make_room,
            hand_over=batching.crowded if batching is not None else None,
            after=after,
        )

    if batching is None:
        return speculate(None, params.max_tokens), pick
    tokens = _alone_or_batched(speculate, drafter, batching, cache, pick, params.max_tokens)
    return tokens, pick


def _alone_or_batched(
    speculate: Callable[[int | None, int], Iterator[int]],
    drafter: Drafter,
    batching: Batching,
    cache: ModelCache,
    pick: TokenPicker,
    total: int,
) -> Iterator[int | None]:
    """`total` tokens: speculatively while the request decodes alone (ended early when others
    come), in the batch while others decode (left when they are gone), and so on. Each part
    goes on from the last token of the one before, yielded and not fed."""
    produced, last = 0, None
    alone = speculate(None, total)
    while True:
        try:
            for last in alone:
                produced += 1
                yield last
        finally:
            alone.close()
        if last is None or produced >= total:
            return
        joined = joined_tokens(
            batching.batch, cache, mx.array([last], dtype=mx.uint32), pick, total - produced,
            leave_when=lambda: not batching.crowded(),
        )  # fmt: skip
        try:
            while True:
                try:
                    token = next(joined)
                except StopIteration as end:
                    queued = end.value
                    break
                if token is None:  # a pause (`DecodeBatch.waits`): passed on
                    yield None
                    continue
                last = token
                produced += 1
                drafter.extend([last])
                yield last
        finally:
            joined.close()
        for last in queued:  # picked in the batch, not read yet (the newest not fed)
            produced += 1
            drafter.extend([last])
            yield last
        if produced >= total:
            return
        alone = speculate(last, total - produced)
