"""mlxkv: an LLM runner on MLX whose KV cache never pays twice for the same tokens."""

from mlxkv.platform.blas import select_blas
from mlxkv.platform.open_files import import_mlx_lm

select_blas()  # must run before mlx is first imported (see mlxkv.platform.blas)
import_mlx_lm()  # before any module imports it: it would cap the open-file limit

# ruff: noqa: E402

from mlxkv.cache import KVCache, ModelCache, QuantizedKVCache, SlidingWindowCache, make_cache
from mlxkv.config import format_bytes
from mlxkv.decoding.grammar import json_schema_grammar
from mlxkv.errors import (
    CacheFullError,
    CacheStateError,
    ContextLengthError,
    GrammarError,
    ImagesNotSupportedError,
    MlxkvError,
    ModelLoadError,
    NotSupportedError,
    RunnerBusyError,
    UnsupportedFormatError,
)
from mlxkv.models.embedding import Embeddings
from mlxkv.runner.prompt_cache.report import MemoryReport
from mlxkv.runner.results import Completion, GenerationChunk
from mlxkv.runner.runner import Runner

__all__ = [
    "CacheFullError",
    "CacheStateError",
    "Completion",
    "ContextLengthError",
    "Embeddings",
    "GenerationChunk",
    "GrammarError",
    "ImagesNotSupportedError",
    "KVCache",
    "MemoryReport",
    "MlxkvError",
    "ModelCache",
    "ModelLoadError",
    "NotSupportedError",
    "QuantizedKVCache",
    "Runner",
    "RunnerBusyError",
    "SlidingWindowCache",
    "UnsupportedFormatError",
    "format_bytes",
    "json_schema_grammar",
    "make_cache",
]
