"""One request's path through the model: prefix lookup, prefill of what the cache lacks,
decoding (plain, speculative or batched with other requests), and the text chunks the caller
streams.

Owns `run_request` (a request's entry claimed and released in one place) and what its reply's
decoder is given (the token picker, a drafter, the window). Does not own the choice of decoder
(`mlxkv.decoding.decoders`), serializing or interleaving requests, thread bookkeeping or the
memory line (`dispatch`), nor the cache policy (`mlxkv.runner.prompt_cache.pool`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass

import mlx.core as mx

from mlxkv.cache.building import make_cache
from mlxkv.cache.model_cache import ModelCache
from mlxkv.decoding.batch import DecodeBatch
from mlxkv.decoding.decoders import decode_reply
from mlxkv.decoding.drafts import DraftModel, NgramDrafter
from mlxkv.decoding.grammar import grammar_processor
from mlxkv.decoding.pause import PAUSE, Pause
from mlxkv.decoding.picker import TokenPicker
from mlxkv.decoding.prefill.chunks import PrefillPlan, fill, fill_steps
from mlxkv.decoding.prefill.scoring import SCORED_STEP_TOKENS, PromptScorer
from mlxkv.decoding.speculative import DraftLength, Speculation
from mlxkv.errors import RestoreBroken
from mlxkv.models.vision import ImagePrompt
from mlxkv.runner.context import ContextWindow
from mlxkv.runner.hooks import RequestEnd, notify
from mlxkv.runner.prefill.fill import PrefillCancelled, fill_prompt
from mlxkv.runner.prefill.group import PrefillGroup
from mlxkv.runner.prompt_cache.entry import CacheEntry
from mlxkv.runner.prompt_cache.pool import CachePool, PrefixHit
from mlxkv.runner.prompt_cache.restore_again import restore_again
from mlxkv.runner.request import Request
from mlxkv.runner.results import Completion, CompletionStats, GenerationChunk
from mlxkv.runner.run_context import RunContext
from mlxkv.runner.text.chunks import emit_chunks
from mlxkv.runner.text.replies import remember_reply
from mlxkv.runner.text.vision_cuts import ImageWindow


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
    request: Request, context: RunContext, *, batching: Batching | None = None
) -> Iterator[GenerationChunk | Pause]:
    """Runs `request` on the pool's nearest entry, in place; yields its chunks, the last one
    with the Completion, and `PAUSE` where interleaved requests run (between prefill
    chunks, waiting for a shared prefix or for prompts prefilled together, joining the decode
    batch; a serial caller skips it).

    The entry is claimed and released here: released however the request ends, and before
    its last chunk is handed out (a caller may start the conversation's next turn as soon as
    it has it, and that turn must find the entry released, holding this one's tokens).

    Args:
        batching: decode in a batch with other requests where possible, taking turns with
            them (first waiting for a prefix one of them is feeding); None: alone.
    """
    tokens, pool = request.tokens, context.pool
    stats = CompletionStats(time.perf_counter(), prompt_tokens=len(tokens), cached=0)
    run = _with_images(context, request)
    if batching is not None:  # interleaved: other requests run between this one's turns
        with batching.prefills.arriving():
            yield from _await_shared_prefix(request, pool)
    if request.cancelled.is_set():  # cancelled while waiting its turn: touch nothing
        yield stats.final_chunk("", "cancelled")
        return
    hit = pool.fetch_nearest(
        tokens,
        reply_start=len(tokens) - request.header_tokens,
        salt=request.cache_salt,
        keep=request.keep,
        label=request.cache_key,
        evict_first=request.evict_first,
        cut_start=request.cut_start,
        drops_before=request.drops_before,
    )
    stats.cached = hit.num_cached
    final = None
    try:
        with contextlib.closing(_generate(request, run, hit, stats, batching)) as chunks:
            for chunk in chunks:
                if chunk is not PAUSE and chunk.completion is not None:
                    final = chunk
                    break
                yield chunk
    finally:  # on the engine thread, the generation closed first (even on error)
        holdings = pool.release(hit.entry)
        context.ended(holdings)
        prompt, images = _held_prompt(request, run)
        end = RequestEnd(
            entry=hit.entry,
            prompt=prompt,
            generated=list(stats.tokens),
            images=images,
            context=context,
        )
        notify(end)
    if final is not None:
        _remember_reply(request, context, final.completion)
        yield final


def _remember_reply(request: Request, context: RunContext, done: Completion) -> None:
    """Keeps the ids of a reply whose text is exactly theirs known by its text, or by what
    the caller knows it by (`Request.reply_key`: a call reply's calls), before its last chunk
    is handed on (the next turn may follow at once): in the model's reply memory, and on disk
    behind the turn's blocks (released first), so a restart renders it sent back as its ids
    too (`text.replies`). A continued reply (`Request.reply_start`) comes back with its start
    as one message: known by both texts (or by what the caller reads in them: the calls of a
    prefilled reply that made some), as the ids of both."""
    prompt, ids, start = request.tokens, done.tokens, request.reply_start
    whole = done
    if start is not None:
        whole = dataclasses.replace(done, text=start.text + done.text)
        ids, prompt = start.ids + ids, prompt[: -len(start.ids)]
    key = None if request.reply_key is None else request.reply_key(whole)
    key = key or whole.text
    tokenizer, salt = context.loaded.tokenizer, request.cache_salt
    after = remember_reply(tokenizer, done, salt, key, ids, prompt)  # its conversation's ids
    if after is not None and (store := context.pool.store) is not None:
        store.write_reply(prompt, ids, key, salt, after)


def _generate(
    request: Request,
    context: RunContext,
    hit: PrefixHit,
    stats: CompletionStats,
    batching: Batching | None,
) -> Iterator[GenerationChunk | Pause]:
    """The request's chunks on its claimed entry: what the cache lacks prefilled, then the
    reply decoded (plain, speculative or in the batch) and turned into text."""
    loaded, plan, pool = context.loaded, context.plan, context.pool
    max_context = context.config.max_context
    model = loaded.model
    start = time.perf_counter()
    scorer, fill_plan = _scoring(request, plan)
    try:
        feed = functools.partial(
            fill_prompt, model, request, stats=stats, plan=fill_plan, scorer=scorer,
            together=_prefilled_with(request, batching),
        )  # fmt: skip
        try:
            logits = yield from feed(hit)
        except RestoreBroken:  # before any chunk was fed: the first forward uses every layer
            hit = restore_again(pool.store, hit, request.tokens)
            stats.cached = hit.num_cached
            logits = yield from feed(hit)
        if scorer is not None:
            yield from _score_cached(request, context, hit.num_cached, scorer, fill_plan)
            stats.prompt_logprobs = scorer.result()
    except PrefillCancelled:
        yield stats.final_chunk("", "cancelled")
        return
    # long enough to measure, and a plain prefill (not one that scores): weighs disk loads
    if len(hit.remaining) >= plan.step_tokens and scorer is None:
        pool.prefill_tokens_per_s = len(hit.remaining) / (time.perf_counter() - start)
    window = _window(request, context, hit.entry)
    draft_cache = _draft_cache_for(hit.entry, request, context.draft, max_context)
    batching = batching if _can_batch(request, hit.entry.cache, max_context, batching) else None
    with batching.counted() if batching is not None else contextlib.nullcontext():
        decoded, pick = _decode(
            request,
            context,
            draft_cache,
            hit.entry.cache,
            logits,
            stats,
            window,
            batching,
        )
        try:
            yield from emit_chunks(loaded.tokenizer, decoded, stats, request, pick)
        finally:  # here, on the engine thread, before the entry is released (even on error)
            decoded.close()


def _with_images(context: RunContext, request: Request) -> RunContext:
    """For a prompt with images: the context with its model bound to them (the encoder's
    output over their placeholders, M-RoPE positions), which its prefill runs on; its reply
    decodes in the batch like any (`_decode`: its row's positions shifted as its images
    make them). Any other request's comes back as it is."""
    loaded = context.loaded
    if loaded.vision is None or not request.images:
        return context
    bound = ImagePrompt(loaded.model, context.pool.encoder, request.tokens, request.images)
    return dataclasses.replace(context, loaded=dataclasses.replace(loaded, model=bound))


def _window(
    request: Request, context: RunContext, entry: CacheEntry
) -> ContextWindow | ImageWindow:
    """The window the reply generates in: a reply with images that may pass it cuts its
    prompt at message boundaries (`ImageWindow`), any other shifts (`ContextWindow`)."""
    model, plan = context.loaded.model, context.plan

    def refill(cache: ModelCache, ids: list[int]) -> None:
        fill(model, cache, ids, plan)

    max_context = context.config.max_context
    if request.reply_cuts is not None:
        return ImageWindow(max_context, request.reply_cuts, model, entry, refill)
    return ContextWindow(max_context, request.keep, context.rotations, refill=refill)


def _held_prompt(request: Request, context: RunContext) -> tuple[list[int], tuple]:
    """The prompt the request's entry holds and its images: the request's, or the cut its
    reply made (`ImageWindow` rebinds the model to it)."""
    model = context.loaded.model
    if isinstance(model, ImagePrompt):
        return model.prompt, tuple(model.spans)
    return list(request.tokens), request.images


def _scoring(request: Request, plan: PrefillPlan) -> tuple[PromptScorer | None, PrefillPlan]:
    """The scorer of a request that asks for its prompt's log-probabilities, and the plan its
    prefill runs with: chunks of at most `SCORED_STEP_TOKENS`."""
    if request.prompt_logprobs is None:
        return None, plan
    step_tokens = min(plan.step_tokens, SCORED_STEP_TOKENS)
    scorer = PromptScorer(request.tokens, request.prompt_logprobs)
    return scorer, dataclasses.replace(plan, step_tokens=step_tokens)


def _score_cached(
    request: Request,
    context: RunContext,
    num_cached: int,
    scorer: PromptScorer,
    plan: PrefillPlan,
) -> Iterator[Pause]:
    """Scores the prompt's first `num_cached` positions, which the cache supplied (its K/V
    hold no logits): fed again on a cache of their own, outside the pool's budget, dropped
    after; pauses (yields `PAUSE`) between chunks, where other requests run.

    Raises:
        PrefillCancelled: the request was cancelled.
    """
    if not num_cached:
        return
    config, model = context.config, context.loaded.model
    cache = make_cache(model, kv_bits=config.kv_bits, kv_group_size=config.kv_group_size)
    for done in fill_steps(model, cache, request.tokens[:num_cached], plan, scorer):
        if request.cancelled.is_set():
            raise PrefillCancelled
        if done < num_cached:
            yield PAUSE


def _prefilled_with(request: Request, batching: Batching | None) -> PrefillGroup | None:
    """The group the request's prompt may be prefilled with: none when not interleaved, nor
    for a seeded request, whose draws must be those it makes alone (from its prompt's logits
    fed alone, not a batched pass's, which round otherwise). A vision model's prompts join
    too, text-only or with images (each row its own encoder rows and positions:
    `mlxkv.runner.prefill.image_rows.PromptRows`); not one whose prompt is scored (a
    batched pass computes no logits but the last)."""
    if batching is None or request.params.seed is not None or request.prompt_logprobs is not None:
        return None
    return batching.prefills


def _await_shared_prefix(request: Request, pool: CachePool) -> Iterator[Pause]:
    """Pauses (yields `PAUSE`) while a request running now feeds a longer prefix of this one's
    prompt than the cache holds, so that this one copies it rather than feeding it again;
    ends at once when cancelled. Only between turns of interleaved requests: the one it
    waits for feeds meanwhile."""
    while not request.cancelled.is_set() and pool.awaits_prefix(request.tokens, request.cache_salt):
        yield PAUSE


def _draft_cache_for(
    entry: CacheEntry, request: Request, draft: DraftModel | None, max_context: int
) -> ModelCache | None:
    """The entry's draft-model cache when the request drafts with the draft model (made on
    first use, bounded as the entry), else None. A prompt with images drafts n-grams: a text
    draft model cannot read them."""
    if draft is None or request.speculative not in ("auto", "draft") or request.images:
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
    context: RunContext,
    draft_cache: ModelCache | None,
    cache: ModelCache,
    logits: mx.array,
    stats: CompletionStats,
    window: ContextWindow | ImageWindow,
    batching: Batching | None = None,
) -> tuple[Iterator[int | Pause], TokenPicker]:
    """The generated token ids of one request, from the prompt's last logits, and the picker
    that samples them. Builds what the decoder needs (the picker with the request's
    processors and grammar; for a speculative mode, its drafter: the draft model's where
    `draft_cache` is given, else n-grams); `mlxkv.decoding.decoders.decode_reply` chooses the
    decoder (plain, speculative, in the batch, or speculative while alone). The reply makes
    room in `window`; a draft model follows its shifts."""
    params, prompt, loaded = request.params, request.tokens, context.loaded
    vocab_size = loaded.vocab_size
    sampling = params.make_sampling(vocab_size, placeholders=bool(request.images))
    processors = list(sampling.processors)
    if request.grammar is not None:
        processors.append(
            grammar_processor(request.grammar, loaded.tokenizer, vocab_size, len(prompt))
        )
    pick = TokenPicker(
        sampling.sampler,
        processors,
        prompt,
        top_logprobs=request.top_logprobs,
        greedy=sampling.distribution is None,
    )
    speculation = None
    if request.speculative is not None:
        if draft_cache is not None:
            drafter = context.draft.drafter(
                draft_cache, prompt, sampling.distribution, context.plan, sampling.processors
            )
            window.on_shift = drafter.follow  # text only (`_draft_cache_for`): it shifts
        else:
            drafter = NgramDrafter(prompt, vocab_size)
        speculation = Speculation(
            drafter=drafter,
            length=DraftLength(gated=request.speculative == "auto"),
            distribution=sampling.distribution,
            counts=stats.drafts,
        )
    tokens = decode_reply(
        loaded.model,
        cache,
        logits,
        pick,
        params.max_tokens,
        make_room=window.make_room,
        speculation=speculation,
        batch=None if batching is None else batching.batch,
        crowded=None if batching is None else batching.crowded,
        position_shift=loaded.model.position_shift if isinstance(loaded.model, ImagePrompt) else 0,
    )
    return tokens, pick
