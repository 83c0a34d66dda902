"""Prefill spread over the CPU's cores, on MLX's CPU backend.

Why: on the CPU backend each MLX stream runs its kernels on one thread, and once a few thousand
tokens are cached a prefill chunk's time goes to attention's softmax, not to BLAS (measured on
SmolLM2: `exp` at about 14 ns per element, three quarters of a 230-token chunk after 3,500
cached tokens). A chunk split in parts, each part fed on a stream of its own (a lane), becomes
a pipeline: part 2 computes layer i (it needs part 1's keys and values of that layer) while
part 1 computes layer i+1, so every core works. OpenBLAS gets cores // lanes threads meanwhile
(the lanes are the parallelism) and its own count back after.

The graph is the one a sequential feed builds, part after part; only where it runs differs. So
every cache kind (K/V, windows, recurrent state, quantized) is fed as before, up to the
rounding of differently shaped matmuls, and `ModelCache.forward` stays all or nothing per part.

Measured on this repository's 2-core CPU (SmolLM2 float32, `benchmarks/serve_agent`): a
230-token chunk after 3,500 cached tokens in 0.70x the time of one stream, 512 tokens on an
empty cache in 0.65x.

Off where it cannot help or is not safe: on a GPU (one device queue), on one core, and under
`mlx.launch` (collectives issued from two streams could run in a different order on each
rank). `MLXKV_PREFILL_LANES=1` (or `RunnerConfig.prefill_lanes=1`) turns it off; N asks
for N lanes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn

from mlxkv.cache.model_cache import ModelCache
from mlxkv.config import env
from mlxkv.platform.blas import blas_threads
from mlxkv.platform.machine import cpu_cores, on_gpu

logger = logging.getLogger(__name__)

MIN_PART_TOKENS = 32  # below this a part's matmuls are too small to be worth a lane
_DEFAULT_MAX_LANES = 2  # measured; more lanes deepen the pipeline's start and end

_thread_streams = threading.local()  # MLX streams belong to the thread that made them


def feed(model: nn.Module, cache: ModelCache, tokens: Sequence[int], lanes: int) -> None:
    """`cache.feed(model, tokens)` (evaluating the cache's arrays only) over up to `lanes` CPU
    lanes, each taking at least `MIN_PART_TOKENS` tokens."""
    parts = min(lanes, len(tokens) // MIN_PART_TOKENS)
    if parts < 2:
        cache.feed(model, tokens)
        return
    bounds = [len(tokens) * i // parts for i in range(parts + 1)]
    for stream, start, end in zip(_streams(parts), bounds[:-1], bounds[1:], strict=True):
        with mx.stream(stream):
            cache.forward(model, tokens[start:end])
    with blas_threads(max(1, cpu_cores() // parts)):
        mx.eval(cache.arrays())


def default_lanes() -> int:
    """Lanes to use when none are set: 1 on a GPU (one device queue) and under `mlx.launch`
    (collectives from two streams could run in a different order on each rank); else
    $MLXKV_PREFILL_LANES, else one per core up to 2."""
    if on_gpu() or (mx.distributed.is_available() and mx.distributed.init().size() > 1):
        return 1
    setting = (env("MLXKV_PREFILL_LANES") or "").strip()
    if setting:
        try:
            return max(1, int(setting))
        except ValueError:
            logger.warning("MLXKV_PREFILL_LANES=%r is not a number of lanes; using 1", setting)
            return 1
    return max(1, min(cpu_cores(), _DEFAULT_MAX_LANES))


def _streams(count: int) -> list[mx.Stream]:
    """`count` CPU streams of the calling thread, made on first use (freed with the thread's
    other streams, see `mlxkv.platform.threads`)."""
    streams = getattr(_thread_streams, "streams", [])
    while len(streams) < count:
        streams.append(mx.new_stream(mx.cpu))
    _thread_streams.streams = streams
    return streams[:count]
