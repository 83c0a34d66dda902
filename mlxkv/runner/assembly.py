"""Setting a Runner up, once: the context window and decode batch its memory holds, the
prompt cache it uses (its entries' pool and, when asked for, the disk tier in the model's own
subdirectory), and the warm-up.

Owns `fit_window`, `choose_max_batch`, `make_layers` (and the measures behind them), `make_pool`
(with the disk tier's snapshot interval), `probe_padded_state` (whether a model's recurrent
state is exact when prompts are prefilled together), `probe_batched_decode` (whether its own
code decodes exactly in a batch) and `warm_up`. Does not own
the pool's policy (`mlxkv.runner.prompt_cache.pool`), the file format
(`mlxkv.runner.disk.store`) or the settings (`mlxkv.config.RunnerConfig`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from mlxkv.cache.batched import BatchedKV, can_batch, can_prefill_together, layer_batches
from mlxkv.cache.building import make_cache
from mlxkv.cache.checkpoints import MAX_CHECKPOINTS
from mlxkv.cache.footprint import SnapshotCost, snapshot_cost
from mlxkv.cache.model_cache import ModelCache
from mlxkv.cache.serialize import ArrayShapes, array_shapes, layout_signature
from mlxkv.config import (
    BATCH_MEMORY_FRACTION,
    CONTEXT_MEMORY_FRACTION,
    DEFAULT_MAX_BATCH,
    RunnerConfig,
    encoder_cache_bytes,
    format_bytes,
)
from mlxkv.decoding.batch import DecodeBatch
from mlxkv.decoding.drafts import DraftModel
from mlxkv.decoding.picker import TokenPicker
from mlxkv.decoding.prefill.batched import Stops, prefill_together
from mlxkv.models.fingerprint import model_fingerprint
from mlxkv.models.loading import LoadedModel
from mlxkv.models.vision import EncoderCache
from mlxkv.platform.machine import memory_bytes
from mlxkv.runner.disk.chains import BLOCK_TOKENS
from mlxkv.runner.disk.files import DiskStoreUnavailable
from mlxkv.runner.disk.snapshots import snapshot_bytes_per_token, snapshot_every_blocks
from mlxkv.runner.disk.store import DiskStore
from mlxkv.runner.prompt_cache.pool import CachePool
from mlxkv.runner.scheduling.engine import EngineThread
from mlxkv.runner.scheduling.lockstep import Lockstep, Solo
from mlxkv.runner.text.replies import MAX_REPLIES, replies_for

logger = logging.getLogger(__name__)

# The warm-up's prefill chunk and draft verification widths (tokens).
_WARMUP_CHUNK_TOKENS = 32
_WARMUP_DRAFT_TOKENS = 4
# The warm-up's batched prompts: two rows of different lengths, so that padding is masked.
_WARMUP_BATCH_PROMPTS = ([0, 0, 0], [0, 0])
# The probe's prompts (ids every vocabulary holds, distinct from the padding's 0): rows of
# different lengths and checkpoints, so that in each stage of the pass (`prefill_together`)
# one row is partly padding and, in the second, one is all padding (Nemotron-H's state was
# exact with a row all padding, off by 2.8 with a row partly padding).
_PROBE_PROMPTS = ([1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12], [13, 14])
_PROBE_STOPS = (Stops(checkpoints=(4,)), Stops(checkpoints=(1,)), Stops())
# How far a row's last logits together may be from alone, relative to their largest |logit|,
# for the model's state to count as exact under padding: above rounding (1e-6 measured on the
# sweep's models that read `lengths`, float32; 2e-2 allowed in half precision,
# tests/tolerances.py) and below padding read into the state (0.21 for Nemotron-H, 0.9 to 1.9
# for Mamba, Jamba, OLMo hybrid, RWKV-7, Bailing linear). A model too close to call stays
# alone, which is exact.
_PROBE_RTOL = 0.05
# The batched-decode probe's prompts: rows far apart in length, so that where a model applies
# one row's left padding to another (mlx-lm's gemma2, as mlxkv does not load it, broadcasts a
# (B, 1, L, S) mask over its (B, kv heads, repeats, L, S) scores: row b's mask on KV head
# b), most of a row is masked.
_DECODE_PROBE_PROMPTS = (list(range(1, 13)), [13, 14])
_DECODE_PROBE_TOKEN = 15


def make_pool(
    loaded: LoadedModel,
    make_entry: Callable[[], ModelCache],
    config: RunnerConfig,
    snapshot_cost: SnapshotCost,
    engine: EngineThread,
) -> CachePool:
    """The pool for these settings, its disk tier indexed (a restart finds its files), told
    every how many tokens a model with state layers snapshots them for it (`disk.snapshots`,
    from the `snapshot_cost` `size_window` measured) and the shapes of the model's own cache
    arrays (a token's forward pass on `engine`), and the replies it keeps known to the
    model's reply memory (`text.replies`); a cache directory that cannot be written leaves
    the tier off, with a warning."""
    store = None
    if config.cache_dir is not None:
        empty: ModelCache = make_entry()
        try:
            store = DiskStore(
                config.cache_dir,
                fingerprint=model_fingerprint(loaded),
                signature=layout_signature(empty),
                max_bytes=config.cache_dir_bytes,
                kv_bits=config.cache_dir_kv_bits,
                trimmable=not empty.needs_checkpoints,
            )
            store.max_pending_bytes = config.cache_bytes
            if not loaded.is_encoder:  # an encoder's cache holds nothing to restore
                store.model_shapes = engine.call(_model_shapes, loaded.model, make_entry)
            if not store.trimmable:
                kv_bits = config.cache_dir_kv_bits
                every = snapshot_every_blocks(snapshot_cost, store.block_tokens, kv_bits)
                store.snapshot_every_tokens = every * store.block_tokens
            # the replies its blocks hold, so a reply sent back renders as their ids again
            stored = store.stored_replies(MAX_REPLIES)
            replies_for(loaded.tokenizer).restore(
                (r.salt, r.text, r.ids, r.context) for r in stored
            )
        except DiskStoreUnavailable as error:
            logger.warning("disk tier off: %s; entries live in memory only", error)
    pool = CachePool(
        make_entry, max_entries=config.cache_entries, max_bytes=config.cache_bytes, store=store
    )
    if loaded.vision is not None:  # its outputs count inside the entries' budget
        pool.encoder = EncoderCache(loaded.vision, encoder_cache_bytes(config.cache_bytes))
    return pool


def _model_shapes(model: nn.Module, make_entry: Callable[[], ModelCache]) -> ArrayShapes | None:
    """The model's cache arrays after one token (`serialize.array_shapes`); None for layers
    the disk tier cannot save (it writes none of them), or a model that cannot take a lone
    token (restores are then held to no shapes: a Runner still starts)."""
    cache = make_entry()
    try:
        mx.eval(cache.forward(model, [0]))
        return array_shapes(cache)
    except Exception as error:  # noqa: BLE001  (whatever the model raises: checks off)
        logger.info("disk cache: restores not held to the model's shapes (%s)", error)
        return None


def size_window(
    loaded: LoadedModel, config: RunnerConfig, engine: EngineThread, lockstep: Lockstep | Solo
) -> tuple[RunnerConfig, SnapshotCost]:
    """`config` with its context window fitted to memory (every rank taking rank 0's) and
    what the state layers' snapshots cost beside the K/V per token (`measure_one_token`; the
    disk tier's snapshot rule and the default decode batch read it). The forward that measures
    them runs on the engine thread: a model that updates weights lazily in its forward (Gemma
    3n's AltUp) leaves arrays only that thread can evaluate later."""
    layers = make_layers(loaded.model, config)
    # an encoder keeps no K/V (and runs no decoder forward to measure them)
    per_token_bytes, cost = (
        (1, SnapshotCost(snapshot_bytes=0, kv_bytes_per_token=0))
        if loaded.is_encoder
        else engine.call(measure_one_token, loaded.model, layers)
    )
    # a disk tier holds its snapshots of state layers until the turn is written
    held = 0
    if config.cache_dir is not None:
        held = snapshot_bytes_per_token(cost, BLOCK_TOKENS, config.cache_dir_kv_bits)
    config = fit_window(config, loaded.max_position_embeddings, cost, held, per_token_bytes)
    return lockstep.leaders_settings(config), cost


def fit_window(
    config: RunnerConfig,
    max_position_embeddings: int | None,
    cost: SnapshotCost,
    held_per_token: int,
    one_token_bytes: int,
) -> RunnerConfig:
    """`config` with its context window: by default the model's maximum capped to what
    the entries' budget holds (`cache_bytes`, else a share of memory; `default_max_context`),
    one reading for both. A window the budget cannot hold is allowed, with a warning: a
    conversation longer than the budget keeps only its first part in the cache after each
    request."""
    budget = config.cache_bytes or int(memory_bytes() * CONTEXT_MEMORY_FRACTION)
    window = config.max_context or default_max_context(
        max_position_embeddings, cost, held_per_token, one_token_bytes, budget
    )
    needed = cost.held_bytes(window, MAX_CHECKPOINTS, held_per_token)
    if config.cache_bytes is not None and needed > config.cache_bytes:
        logger.warning(
            "the context window (%d tokens) needs %s of K/V but cache_bytes is %s: a "
            "conversation keeps only its first part in the cache between requests "
            "(raise cache_bytes or lower max_context)",
            window,
            format_bytes(needed),
            format_bytes(config.cache_bytes),
        )
    return config.replace(max_context=window)


def measure_one_token(model: nn.Module, cache: ModelCache) -> tuple[int, SnapshotCost]:
    """Bytes one token's K/V (and state) take in this cache layout, and what a snapshot of its
    state layers costs beside its K/V (`footprint.snapshot_cost`), measured by feeding one
    token through a scratch copy.

    The forward is evaluated: a model may reassign its weights lazily in its forward (Gemma
    3n's AltUp clips two on every call), and arrays left unevaluated could not be evaluated
    on another thread (another Runner's engine, or the caller's)."""
    scratch = cache.copy()
    logits = scratch.forward(model, [0])
    mx.eval(logits, model.parameters())
    return max(scratch.used_bytes, 1), snapshot_cost(scratch.layers)


def default_max_context(
    max_position_embeddings: int | None,
    cost: SnapshotCost,
    held_per_token: int,
    one_token_bytes: int,
    budget_bytes: int,
) -> int:
    """The model's own maximum, capped to the tokens an entry holds within `budget_bytes`:
    the K/V that grow with each token (and the disk tier's `held_per_token`), beside its
    state layers and their checkpoints, whose size no length changes (`SnapshotCost`). A
    token's whole one-token measure (`one_token_bytes`) would count a recurrent layer's state
    once per token and every window layer as if it grew: a hybrid or windowed model got a
    window several times smaller than its memory holds. A model whose layers are all state
    (Mamba) grows with no token: the one-token measure still caps it where the model states
    no maximum."""
    growing = cost.kv_bytes_per_token + held_per_token
    if growing:
        fixed = cost.held_bytes(0, MAX_CHECKPOINTS)
        fits = max(2, (budget_bytes - fixed) // growing)
    else:
        fits = max(2, budget_bytes // one_token_bytes)
    return min(max_position_embeddings or fits, fits)


def default_max_batch(window_tokens: int, cost: SnapshotCost, memory_bytes: int) -> int:
    """Rows of a decode batch that fit in `BATCH_MEMORY_FRACTION` of memory when each holds a
    whole context window (rows are padded to the longest): K/V of the layers that trim back
    for every token, and once per row a full state layer (`cost.snapshot_bytes`: an
    `ArraysCache`'s arrays, a sliding window's `window` slots, the same at any length);
    between 1 and `DEFAULT_MAX_BATCH`."""
    row_bytes = cost.held_bytes(window_tokens)
    rows = int(memory_bytes * BATCH_MEMORY_FRACTION) // max(1, row_bytes)
    return max(1, min(DEFAULT_MAX_BATCH, rows))


def choose_max_batch(
    loaded: LoadedModel,
    config: RunnerConfig,
    cost: SnapshotCost,
    engine: EngineThread,
    lockstep: Lockstep | Solo,
) -> int:
    """`config.max_batch`, else the rows that fit (`default_max_batch`, from `cost`, what
    `measure_one_token` read of one token's layers); 1 for a model whose KV-reuse layers
    place their queries at the key length (mlx-lm's AFM: `offset=S - L`), which a batch's
    left padding moves, so a shorter row would answer otherwise. Logs when the model's cache
    layers (an empty cache of them) do not batch (naming those that do not), or
    decode in the batch but prefill alone (`can_prefill_together`; recurrent state: the
    probe at load, `probe_padded_state`, logs its own outcome); 1 for a model whose own code
    cannot decode in a batch (`probe_batched_decode`, on the engine thread; not where ranks are
    sharded: their requests never batch, `dispatch`)."""
    model, empty = loaded.model, make_layers(loaded.model, config)
    max_batch = config.max_batch or default_max_batch(config.max_context, cost, memory_bytes())
    if max_batch > 1 and getattr(getattr(model, "model", None), "kv_reuse_layers", None):
        logger.info(
            "this model's KV-reuse layers place their queries at the key length, which a "
            "batch's padding moves: batched streams take turns, decoding one at a time"
        )
        return 1
    if max_batch > 1 and not can_batch(empty):
        logger.info(
            "this model's cache layers (%s) do not batch: batched streams take turns, "
            "decoding one at a time",
            ", ".join(sorted({type(x).__name__ for x in empty if not layer_batches(x)})),
        )
    elif max_batch > 1 and not can_prefill_together(empty, padded_state_exact=True):
        logger.info(
            "this model's cache layers (%s) decode in the batch; prompts are prefilled alone",
            ", ".join(sorted({type(layer).__name__ for layer in empty})),
        )
    if max_batch > 1 and not lockstep.sharded and not loaded.is_encoder:
        return engine.call(probe_batched_decode, loaded, config, max_batch)
    return max_batch


def probe_padded_state(loaded: LoadedModel, config: RunnerConfig, max_batch: int) -> bool:
    """Whether this model's recurrent state stays exact when prompts are prefilled together
    (`can_prefill_together`'s `padded_state_exact`): three prompts of different lengths fed
    together (`_PROBE_PROMPTS`) and each alone, their last logits compared (`_PROBE_RTOL`).
    Only a model that reads `ArraysCache.lengths` stops its state before a row's padding, and
    no cache can tell which; a model that fails prefills each prompt alone, exact. Runs (and
    logs its outcome) only where it decides something: batches of 2 or more, state layers that
    would otherwise be prefilled together (a vision model's layers are K/V and windows: it
    never runs there)."""
    model = loaded.model
    empty = make_layers(model, config)
    if max_batch < 2 or can_prefill_together(empty):
        return False
    if not can_prefill_together(empty, padded_state_exact=True):
        return False
    caches = [make_layers(model, config) for _ in _PROBE_PROMPTS]
    together = prefill_together(
        model, caches, _PROBE_PROMPTS, stops=_PROBE_STOPS, padded_state_exact=True
    )
    worst = 0.0
    for logits, prompt in zip(together, _PROBE_PROMPTS, strict=True):
        alone = make_layers(model, config).forward(model, prompt)[:, -1, :]
        scale = max(1.0, mx.abs(alone).max().item())
        worst = max(worst, mx.abs(logits - alone).max().item() / scale)
    exact = worst <= _PROBE_RTOL
    logger.info(
        "prefill probe: model_type=%s state_exact=%s max_rel_diff=%.2g: prompts are prefilled %s",
        loaded.config.get("model_type"),
        exact,
        worst,
        "together" if exact else "alone (its recurrent layers read the padding)",
    )
    return exact


def probe_batched_decode(loaded: LoadedModel, config: RunnerConfig, max_batch: int) -> int:
    """`max_batch`, or 1 where this model cannot decode in a batch: two prompts of different
    lengths (`_DECODE_PROBE_PROMPTS`) prefilled alone, joined, one batched step, the rows
    parted, their logits against each alone (`_PROBE_RTOL`). A model whose own code reads the
    batch wrongly (mlx-lm's own gemma2's mask on the wrong rows; gpt_bigcode's
    `cache[0].offset` read as one number) or whose layers a batch cannot part answers
    otherwise or raises; it decodes alone, exact, and the log says why. Runs only where the
    cache's layers batch and `max_batch` > 1."""
    model = loaded.model
    caches = [make_layers(model, config) for _ in _DECODE_PROBE_PROMPTS]
    if max_batch < 2 or not can_batch(caches[0]):
        return max_batch
    prompts = zip(caches, _DECODE_PROBE_PROMPTS, strict=True)
    mx.eval([cache.forward(model, prompt) for cache, prompt in prompts])
    # uint32, as every step feeds: a vision model's ids are compared with its placeholders'
    # (from 2**31), which int32 ids cannot be compared with
    step = mx.array([[_DECODE_PROBE_TOKEN]] * len(caches), dtype=mx.uint32)
    batched = BatchedKV()
    try:
        for cache in caches:
            batched.join(cache)
        together = model(step, cache=batched.layers)[:, -1, :]
        mx.eval(together, [batched.part(0, cache.layers) for cache in caches])
    except Exception as error:  # the model's own code or mlx-lm's batched classes
        return _decodes_alone(loaded, f"{type(error).__name__}: {error}")
    worst = 0.0
    for row, cache in enumerate(caches):
        alone = cache.forward(model, [_DECODE_PROBE_TOKEN])[:, -1, :]
        scale = max(1.0, mx.abs(alone).max().item())
        worst = max(worst, mx.abs(together[row] - alone[0]).max().item() / scale)
    if worst > _PROBE_RTOL:
        return _decodes_alone(loaded, f"max_rel_diff={worst:.2g}")
    return max_batch


def _decodes_alone(loaded: LoadedModel, why: str) -> int:
    logger.info(
        "batched decode probe: model_type=%s %s: batched streams take turns, decoding one at "
        "a time",
        loaded.config.get("model_type"),
        why,
    )
    return 1


def make_layers(model: nn.Module, config: RunnerConfig) -> ModelCache:
    """An empty cache for `model` with `config`'s K/V kind (bits), holding any length."""
    return make_cache(model, kv_bits=config.kv_bits, kv_group_size=config.kv_group_size)


def warm_up(
    loaded: LoadedModel, draft: DraftModel | None, config: RunnerConfig, max_batch: int
) -> None:
    """One forward pass per shape class a request meets (a prefill chunk, a draft's
    verification, a decode step; with `max_batch` over 1 and K/V that batch, prompts prefilled
    together and batched decode steps) on scratch caches, for the model and the draft model:
    MLX compiles kernels for new shapes (9.8 s for the first request on an H100), here instead
    of in the first user's request (recurrent state prefilled together compiles in
    `probe_padded_state`, which feeds that path). Touches no entry."""
    if loaded.is_encoder:  # nothing generates: the first embedding compiles its own shapes
        return
    start = time.perf_counter()
    models = [(loaded.model, make_layers(loaded.model, config))]
    if draft is not None:
        models.append((draft.loaded.model, draft.make_cache()))
    chunk = min(_WARMUP_CHUNK_TOKENS, config.max_context - _WARMUP_DRAFT_TOKENS - 1)
    for model, cache in models:
        for width in (chunk, _WARMUP_DRAFT_TOKENS, 1):
            if width > 0:
                mx.eval(mx.argmax(cache.forward(model, [0] * width)[:, -1, :], axis=-1))
    if max_batch > 1 and can_batch(models[0][1]):
        _warm_up_batch(loaded.model, config)
    logger.info("warm-up: %.2f s", time.perf_counter() - start)


def _warm_up_batch(model: nn.Module, config: RunnerConfig) -> None:
    """Two prompts prefilled together (where the cache's layers allow: else each alone; text
    ids, as a vision model's text-only prompts are fed), then a batched decode step, as
    concurrent requests run (the drafts of speculation never batch): the batched path's own
    kernels (padding masks, the rows' layers joined and parted, (B, 1) steps)
    compile here rather than in the first requests that decode together."""
    caches = [make_layers(model, config) for _ in _WARMUP_BATCH_PROMPTS]
    if can_prefill_together(caches[0]):
        last_logits = prefill_together(model, caches, _WARMUP_BATCH_PROMPTS)
    else:
        prompts = zip(caches, _WARMUP_BATCH_PROMPTS, strict=True)
        last_logits = [cache.forward(model, prompt)[:, -1, :] for cache, prompt in prompts]
    batch = DecodeBatch(model, max_rows=len(caches))
    greedy = TokenPicker(lambda logits: mx.argmax(logits, axis=-1), [], [], greedy=True)
    rows = [
        batch.join(cache, mx.argmax(logits, axis=-1), greedy, 1)
        for cache, logits in zip(caches, last_logits, strict=True)
    ]
    for row in rows:
        batch.next_token(row)  # one step for both; each row then has its token and leaves
